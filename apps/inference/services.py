"""Every change to the model registry (its deletion: apps.inference.model_deletion), the
pre-check of a node's deletion that this app registers (the models registered on the
node), and every change to an inference service: its creation under quota, its replica
count (scale_service), its state (move_service, by the pure state machine of
apps.inference.sleep), a user's scale, stop and wake (each asking the policy once, for
the API and the portal alike) and the record of each decision. Replica tasks move only
through apps.tasks.services (create_tasks, stop_tasks, requeue_replicas), so the one CAS
path (move_tasks) applies to them as to any task."""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.http import Http404
from rest_framework.exceptions import ValidationError

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.alerts.services import raise_alert
from apps.core.clock import utcnow
from apps.core.error_codes import CoreErrorCode
from apps.core.errors import Conflict
from apps.inference import autoscale, rebuild, sleep, windows
from apps.inference.choices import ServiceStatus
from apps.inference.error_codes import InferenceErrorCode
from apps.inference.models import InferenceService, Model, ServiceDecision
from apps.inference.selectors import registered_on
from apps.nodes.models import Node
from apps.tasks.choices import TERMINAL, GroupKind, GroupPlacement, TaskKind, TaskRuntime, TaskStatus
from apps.tasks.models import Task, TaskGroup
from apps.tasks.services import (
    REPLICA_REQUEUE_FROM,
    create_tasks,
    member_name,
    move_tasks,
    record_events,
    requeue_replicas,
    stop_tasks,
    task_event,
)
from apps.tasks.submission import check_secrets
from apps.tenants import policy


def pinned_nodes(tenant, node_ids: list[str]) -> list[Node]:
    """The nodes a model is registered on, each one the tenant may use (shared, or its
    own dedicated node); any other id is unknown (400 on `nodes`), so another tenant's
    node does not reveal that it exists."""
    nodes = {node.pk: node for node in Node.objects.usable_by(tenant.pk).filter(pk__in=node_ids)}
    unknown = [node_id for node_id in node_ids if node_id not in nodes]
    if unknown:
        raise ValidationError({"nodes": [f"No node '{node_id}'." for node_id in unknown]})
    return [nodes[node_id] for node_id in node_ids]


UNIQUE_NAME = "inference_model_tenant_name_unique"


def node_gone() -> ValidationError:
    return ValidationError({"nodes": ["A node was deleted meanwhile; reload and try again."]})


def exists_conflict(tenant, name: str) -> Conflict:
    return Conflict(f"Tenant '{tenant.slug}' already has a model named '{name}'.", InferenceErrorCode.MODEL_EXISTS)


def constraint(exc: IntegrityError) -> str:
    diag = getattr(exc.__cause__, "diag", None)
    return getattr(diag, "constraint_name", "") or ""


def register_model(principal, validated: dict) -> Model:
    """A model from ModelCreateSerializer's validated data, for the tenant the request acts
    for. Raises ValidationError (400), PermissionDenied (403), Http404 (a tenant not the
    caller's) and Conflict (409, the name is taken); nothing is written when it raises."""
    data = dict(validated)
    tenant = policy.acting_tenant(
        principal, data.pop("tenant", None), required="Required: the slug of the tenant the model belongs to."
    )
    policy.check_may_manage_models(principal, tenant)
    nodes = pinned_nodes(tenant, data.pop("nodes", []))
    if Model.objects.filter(tenant=tenant, name=data["name"]).exists():
        raise exists_conflict(tenant, data["name"])
    try:
        with transaction.atomic():
            model = Model.objects.create(tenant=tenant, **data)
            model.nodes.set(nodes)
    except IntegrityError as exc:  # the same name registered at the same moment, or a node deleted
        if constraint(exc) == UNIQUE_NAME:
            raise exists_conflict(tenant, data["name"]) from None
        raise node_gone() from None
    return model


def update_model(principal, model: Model, changes: dict) -> Model:
    """Change a model's size, engines or nodes (ModelUpdateSerializer's validated data;
    a field left out is unchanged). Its name, source and format are what clients and
    replicas rely on: a new model is registered instead."""
    policy.check_may_manage_models(principal, model.tenant)
    changes = dict(changes)
    nodes = pinned_nodes(model.tenant, changes.pop("nodes")) if "nodes" in changes else None
    try:
        with transaction.atomic():
            locked = Model.objects.select_for_update().get(pk=model.pk)
            for field, value in changes.items():
                setattr(locked, field, value)
            locked.save()
            if nodes is not None:
                locked.nodes.set(nodes)
    except IntegrityError:  # a node deleted between the check and the write
        raise node_gone() from None
    return locked


# --- the node deletion's pre-check of the models registered on it ---------------------


def named(models: list[Model], principal) -> tuple[list[str], int]:
    """`tenant/name` of the models the principal may see (None: everyone's, the admin's
    operators), and how many others there are."""
    if principal is None or principal.is_operator:
        shown = models
    else:
        shown = [model for model in models if principal.is_tenant and model.tenant_id == principal.tenant.pk]
    return [f"{model.tenant.slug}/{model.name}" for model in shown], len(models) - len(shown)


def clear_models_on(node: Node, *, force: bool, principal) -> dict:
    """The pre-check of a node's deletion this app registers with apps.nodes.services
    (apps.inference.apps), run under the node's lock after the active tasks' check: the
    models registered on the node are a 409 naming them, unless `force`; with force, a
    model registered on this node only is deleted, one registered elsewhere too loses this
    node, and the answer says which. `principal` decides which models are named (another
    tenant's are only counted); None names all (the operators' admin)."""
    models = registered_on(node)
    if models and not force:
        shown, hidden = named(models, principal)
        listed = ", ".join(shown[:50]) + (f" and {hidden} of other tenants" if hidden else "")
        raise Conflict(
            f"Node '{node.pk}' has models registered on it: {listed}. "
            "Delete with force to remove those registrations (a model registered on this node only is deleted).",
            InferenceErrorCode.NODE_HAS_MODELS,
        )
    only_here = [model for model in models if model.nodes.count() == 1]
    elsewhere = [model for model in models if model not in only_here]
    Model.objects.filter(pk__in=[model.pk for model in only_here]).delete()
    node.registered_models.clear()  # the registrations of the models that stay
    deleted, hidden_deleted = named(only_here, principal)
    unregistered, hidden_unregistered = named(elsewhere, principal)
    return {
        "deleted_models": deleted,  # registered on this node only: deleted with it
        "unregistered_models": unregistered,  # registered elsewhere too: they stay, without this node
        "other_tenants_models": hidden_deleted + hidden_unregistered,  # of those, the caller's unseen ones
    }


# --- inference services ---------------------------------------------------------------------

DEFAULT_HEALTH_PROBE = {"path": "/v1/models"}
# A replica serves until it is stopped: the agent's run time-out must never end it.
REPLICA_TIMEOUT_SECONDS = 2**31 - 1
# The service states in which replicas run (or are being started): a scale adds or stops
# replica tasks; in the others (sleeping, paused) only the count changes, and the wake or
# the window's resume starts the slots below it.
ACTIVE_STATES = (ServiceStatus.STARTING, ServiceStatus.RUNNING, ServiceStatus.WAKING)
ENDED_STATES = (ServiceStatus.STOPPING, ServiceStatus.STOPPED)


def record_decision(
    service: InferenceService,
    source: str,
    action: str,
    reason: str,
    *,
    from_replicas: int | None = None,
    to_replicas: int | None = None,
    details: dict | None = None,
) -> ServiceDecision:
    """One row of the service's history (what the portal shows): who decided (autoscaler,
    window, sleep, wake, rebuild, user), what, and why with the figures."""
    return ServiceDecision.objects.create(
        service_id=service.pk,
        source=source,
        action=action,
        from_replicas=from_replicas,
        to_replicas=to_replicas,
        reason=reason[:2000],
        details=details or {},
    )


def scaling_policy(service: InferenceService) -> autoscale.ScalingPolicy:
    """The service's autoscaling policy, its bounds the service's own."""
    return autoscale.parse_policy(
        {**(service.autoscaling or {}), "min_replicas": service.min_replicas, "max_replicas": service.max_replicas}
    )


def sleep_policy(service: InferenceService) -> sleep.SleepPolicy:
    after = service.sleep_after_seconds
    return sleep.SleepPolicy(sleep_after_s=float(after) if after is not None else None)


def _policy_errors(data: dict) -> dict[str, list[str]]:
    """The service's policies checked by their pure modules (the API checks them too;
    this keeps a service that the jobs cannot read from being written by any caller)."""
    errors: dict[str, list[str]] = {}
    low, high = data["min_replicas"], data["max_replicas"]
    if low < 1:
        errors["min_replicas"] = ["At least 1 (going to zero is sleeping's job)."]
    if high < low:
        errors["max_replicas"] = [f"Must not be below min_replicas ({low})."]
    if data.get("gpus_per_replica", 1) == 0 and not data.get("gpu_memory_mb"):
        errors["gpu_memory_mb"] = [
            "Required with gpus_per_replica 0: each replica's share of one card, in MB "
            "(docs/inference.md#memory-share-replicas)."
        ]
    try:
        autoscale.parse_policy({**(data.get("autoscaling") or {}), "min_replicas": max(low, 1), "max_replicas": high})
    except autoscale.PolicyError as exc:
        errors["autoscaling"] = exc.errors
    if data.get("window") is not None:
        problems = windows.validate_window(data["window"])
        if problems:
            errors["window"] = problems
    after = data.get("sleep_after_seconds")
    if after is not None:
        problems = sleep.validate_sleep_policy(sleep.SleepPolicy(sleep_after_s=after))
        if problems:
            errors["sleep_after_seconds"] = problems
    return errors


def _model_of(tenant, model) -> Model:
    if isinstance(model, Model):
        if model.tenant_id != tenant.pk:
            raise ValidationError({"model": [f"No model named '{model.name}' in tenant '{tenant.slug}'."]})
        return model
    found = Model.objects.filter(tenant=tenant, name=model).first()
    if found is None:
        raise ValidationError({"model": [f"No model named '{model}' in tenant '{tenant.slug}'."]})
    return found


def replica_resources(service: InferenceService) -> str:
    """What one replica holds, in words: "2 nvidia GPUs" or "8192 MB of one nvidia GPU"."""
    group = service.group
    if service.memory_share:
        return f"{service.gpu_memory_mb} MB of one {group.gpu_type} GPU"
    return f"{group.gpus_per_worker} {group.gpu_type} GPUs"


def replica_spec(service: InferenceService, group: TaskGroup, model: Model, rank: int) -> dict:
    """The Task fields of the replica in slot `rank`: an inference task of the group with
    the service's engine, model and resources (the scheduler gives it a host port at bind,
    the agent's engine router launches `serving`)."""
    return {
        "kind": TaskKind.INFERENCE,
        "group": group,
        "rank": rank,
        "name": member_name(group.name, rank),
        "image": group.image,
        "env": group.env,
        # a memory-share replica is a memory-only task: a slice of one card (apps.slices)
        "gpu_required": 0 if service.memory_share else group.gpus_per_worker,
        "gpu_type": group.gpu_type,
        "gpu_memory_mb": service.gpu_memory_mb,
        "memory_request_mb": service.memory_request_mb,
        "priority": group.priority,
        "labels": group.labels,
        "preemptible": False,
        "timeout_seconds": REPLICA_TIMEOUT_SECONDS,
        "health_probe": service.health_probe or dict(DEFAULT_HEALTH_PROBE),
        "serving": {
            "engine": service.engine,
            "model": model.name,
            "format": model.format,
            "source_kind": model.source_kind,  # the agent ensures the model by it before the engine starts
            "source": model.source,
            "args": list(service.engine_args or []),
        },
    }


def create_service(principal, data: dict) -> InferenceService:
    """An inference service from the validated body of POST /api/v1/inference-services:
    its group (kind inference, placement replicas), the service row and `min_replicas`
    replica tasks, all in one transaction and all or nothing against the tenant's quota
    (min_replicas × gpus_per_replica GPUs, checked under the tenant's lock as
    create_group does; with gpus_per_replica 0, min_replicas × gpu_memory_mb MB of GPU
    memory and no GPUs, as memory-only tasks count; Conflict quota_exceeded and nothing
    written), and the decision
    that records it. Raises ValidationError (400: an unknown model, a policy its module
    refuses), PermissionDenied (403), Http404 (a tenant not the caller's)."""
    data = dict(data)
    tenant = policy.acting_tenant(
        principal, data.pop("tenant", None), required="Required: the slug of the tenant the service runs for."
    )
    policy.check_may_create_tasks(principal, tenant)
    low = data.get("min_replicas", 1)
    data.setdefault("max_replicas", low)
    data["min_replicas"] = low
    errors = _policy_errors(data)
    if errors:
        raise ValidationError(errors)
    model = _model_of(tenant, data["model"])
    env = data.get("env") or {}
    check_secrets(tenant, env, None)
    user = getattr(principal, "user", None)
    group = TaskGroup(
        tenant=tenant,
        created_by=user,
        name=data["name"],
        kind=GroupKind.INFERENCE,
        placement=GroupPlacement.REPLICAS,
        world_size=low,
        gpus_per_worker=max(data.get("gpus_per_replica", 1), 1),  # a share is of one card
        gpu_type=data["gpu_type"],
        image=data.get("image") or "auto",
        env=env,
        priority=data.get("priority", 50),
        labels=data.get("labels") or {},
        # the replicas' hard placement constraints (apps.tasks.services.with_group_constraints)
        runtime=data.get("runtime") or TaskRuntime.AUTO,
        affinity=data.get("affinity") or {},
        anti_affinity=data.get("anti_affinity") or {},
    )
    service = InferenceService(
        group=group,
        model=model,
        engine=data.get("engine") or "auto",
        gpu_memory_mb=data.get("gpu_memory_mb"),
        memory_share=data.get("gpus_per_replica", 1) == 0,
        memory_request_mb=data.get("memory_request_mb"),
        engine_args=list(data.get("engine_args") or []),
        health_probe=data.get("health_probe") or None,
        min_replicas=low,
        max_replicas=data["max_replicas"],
        replicas=low,
        autoscaling=data.get("autoscaling") or {},
        window=data.get("window"),
        sleep_after_seconds=data.get("sleep_after_seconds"),
        lendable=data.get("lendable", True),
        state=ServiceStatus.STARTING,
    )

    def write_group_and_service():  # under the tenant's lock, once the quota check passed
        # the model row locked as its deletion locks it (apps.inference.model_deletion):
        # a model deleted meanwhile is the 400 it would have been, never a foreign-key 500
        if not Model.objects.select_for_update().filter(pk=model.pk).exists():
            raise ValidationError({"model": [f"No model named '{model.name}' in tenant '{tenant.slug}'."]})
        group.save()
        service.group = group
        service.save(force_insert=True)
        record_decision(
            service,
            "user",
            "create",
            f"created with {low} replicas ({low} × {replica_resources(service)})",
            to_replicas=low,
        )

    specs = [replica_spec(service, group, model, rank) for rank in range(low)]
    # one transaction (create_tasks'); a refusal raises after it, so the quota alert stays
    create_tasks(tenant, specs, created_by=user, before_insert=write_group_and_service)
    return service


def _lock(service: InferenceService) -> InferenceService:
    return InferenceService.objects.select_for_update().select_related("group", "model").get(pk=service.pk)


def _slots(service: InferenceService) -> dict[int, tuple[int, str]]:
    """rank -> (task id, status) of the service's replica slots."""
    return {
        rank: (pk, status)
        for pk, rank, status in Task.objects.filter(group_id=service.pk).values_list("pk", "rank", "status")
    }


def start_slots(service: InferenceService, count: int, *, why: str) -> dict[str, list[int]]:
    """Bring the slots below `count` up: ended ones requeued (the same task row, a new
    attempt), missing ranks created; slots already active are left as they are. Both
    under the tenant's quota (Conflict quota_exceeded: nothing moved or created)."""
    slots = _slots(service)
    ended = [slots[rank][0] for rank in range(count) if rank in slots and slots[rank][1] in REPLICA_REQUEUE_FROM]
    missing = [rank for rank in range(count) if rank not in slots]
    with transaction.atomic():
        requeued = requeue_replicas(ended, why=why) if ended else []
        created = []
        if missing:
            group, model = service.group, service.model
            specs = [replica_spec(service, group, model, rank) for rank in missing]
            created = [task.pk for task in create_tasks(group.tenant, specs, created_by=group.created_by)]
    return {"requeued": requeued, "created": created}


def stop_slots(service: InferenceService, *, from_rank: int = 0) -> list[int]:
    """The stop intent for the service's active replicas of rank `from_rank` and above
    (all of them by default): queued ones cancelled, running ones asked to stop, so their
    cards are freed."""
    live = Task.objects.filter(group_id=service.pk, rank__gte=from_rank).exclude(status__in=TERMINAL)
    return stop_tasks(list(live.order_by("-rank").values_list("pk", flat=True)))


def scale_service(
    service: InferenceService,
    replicas: int,
    *,
    source: str,
    reason: str,
    details: dict | None = None,
    action: str | None = None,
) -> bool:
    """Set the count the service asks for, by CAS on the count `service` was read with:
    False when someone changed it first (nothing done). In a starting, running or waking
    service the replicas follow at once: slots below the new count started (ended ones
    requeued first, then new ranks), the surplus stopped (highest ranks first); asleep or
    paused, only the count changes and the wake or the resume starts them. A user's count
    is between min and max; the window may go to 0 (its pause) and down to its scale_to.
    Raises ValidationError (a count out of bounds), Conflict (the service has been
    stopped, or the quota refuses the replicas added: nothing changed). `action`: the
    decision's, when not scale_up / scale_down (a loan's borrowed and returned)."""
    low = service.min_replicas if source == "user" else 0
    if not low <= replicas <= service.max_replicas:
        raise ValidationError(
            {"replicas": [f"Must be between {low} and {service.max_replicas} (the service's bounds)."]}
        )
    if service.state in ENDED_STATES:
        raise Conflict(
            f"Service {service.group.name} is {service.state} and cannot be scaled.", CoreErrorCode.INVALID_STATE
        )
    before = service.replicas
    if replicas == before:
        return True
    direction = autoscale.Direction.UP if replicas > before else autoscale.Direction.DOWN
    now = utcnow()
    with transaction.atomic():
        won = InferenceService.objects.filter(pk=service.pk, replicas=before).exclude(state__in=ENDED_STATES)
        if not won.update(replicas=replicas, last_scaled_at=now, last_scale_direction=direction, updated_at=now):
            return False
        locked = _lock(service)
        if locked.state in ACTIVE_STATES:
            if direction == autoscale.Direction.UP:
                start_slots(locked, replicas, why=f"scaled up {before} → {replicas} ({source}): {reason}")
            else:
                stop_slots(locked, from_rank=replicas)
        record_decision(
            locked,
            source,
            action or f"scale_{direction}",
            reason,
            from_replicas=before,
            to_replicas=replicas,
            details=details,
        )
    service.replicas, service.last_scaled_at, service.last_scale_direction = replicas, now, str(direction)
    return True


def move_service(
    service: InferenceService,
    event: sleep.Event,
    *,
    source: str,
    reason: str,
    details: dict | None = None,
    action: str | None = None,
) -> bool:
    """Move the service's state by `event` (apps.inference.sleep.transition; an illegal
    pair is a Conflict invalid_state naming what the state takes), by CAS on the state
    `service` was read with (False: someone moved it first, nothing done), and apply the
    transition's effects in the same transaction: sleep, pause and stop stop the
    replicas' tasks (their cards freed); wake and resume start the slots below the count.
    A wake that timed out raises an alert. A move that changes nothing (a second wake)
    is True and records nothing. `action`: the decision's, when not the event's name."""
    try:
        move = sleep.transition(sleep.ServiceState(service.state), sleep.Event(event))
    except sleep.IllegalTransition as exc:
        raise Conflict(f"Service {service.group.name}: {exc}.", CoreErrorCode.INVALID_STATE) from None
    if not move.changed:
        return True
    now = utcnow()
    changes = {"state": move.target, "updated_at": now}
    if move.target != move.source:
        changes["state_changed_at"] = now
    with transaction.atomic():
        if not InferenceService.objects.filter(pk=service.pk, state=move.source).update(**changes):
            return False
        locked = _lock(service)
        effects = set(move.effects)
        if effects & {sleep.Effect.SLEEP_REPLICAS, sleep.Effect.PAUSE_REPLICAS, sleep.Effect.STOP_REPLICAS}:
            stop_slots(locked)
        if effects & {sleep.Effect.WAKE_REPLICAS, sleep.Effect.RESUME_REPLICAS}:
            start_slots(locked, locked.replicas, why=f"service {move.event} ({source}): {reason}")
        if sleep.Effect.RAISE_ALERT in effects:
            _alert_wake_timed_out(locked, reason)
        record_decision(
            locked,
            source,
            action or str(move.event),
            f"{move.source} → {move.target}: {reason}" if move.target != move.source else reason,
            from_replicas=locked.replicas,
            to_replicas=locked.replicas,
            details=details,
        )
    service.state = move.target
    if "state_changed_at" in changes:
        service.state_changed_at = now
    return True


def _alert_wake_timed_out(service: InferenceService, reason: str) -> None:
    """The wake time-out's alert, attached to the service's first replica (the alerts app
    has no service scope: a TASK alert is what the service's tenant sees)."""
    first = Task.objects.filter(group_id=service.pk).order_by("rank").values_list("pk", "node_id").first()
    if first is None:
        return
    raise_alert(
        type=AlertType.TASK_FAILED,
        severity=Severity.WARNING,
        scope=AlertScope.TASK,
        key=alert_keys.inference_wake_timed_out(service.pk, utcnow()),
        message=f"Inference service {service.group.name} did not wake: {reason}; it is asleep again, "
        "the next request tries again.",
        node_id=first[1] or "",
        task_id=first[0],
        tenant_id=service.group.tenant_id,
        details={"service_id": service.pk, "cause": "wake_timed_out"},
    )


# --- a user's scale, stop and wake: the API's views and the portal's buttons alike --------

# A sleeping service takes a scale (only its count changes; the wake starts that many); a
# paused one, or one whose window holds its count, would have it overwritten by the
# window's restore, so the user is told instead.
NOT_SCALED = {
    ServiceStatus.STOPPING: "it is stopping",
    ServiceStatus.STOPPED: "it is stopped",
    ServiceStatus.PAUSED: "its scheduling window has paused it",
}


def may_manage(principal, service: InferenceService) -> bool:
    """Scale, stop and wake: as stopping a task (viewers only look). For showing the
    buttons; the actions ask the policy themselves."""
    return policy.may_stop_task(principal, service.group)


def _check_may_manage(principal, service: InferenceService) -> None:
    """What each user action asks, once: another tenant's service does not exist for the
    caller (404); a viewer only looks (403)."""
    tenant = service.group.tenant
    if not principal.is_operator and not (principal.is_tenant and principal.tenant.pk == tenant.pk):
        raise Http404("No such inference service.")
    policy.check_may_stop_task(principal, service.group)


def _who(principal) -> str:
    return principal.user.username if principal.user is not None else "an API key"


def scale_by_user(principal, service: InferenceService, replicas: int) -> bool:
    """A user's scale to `replicas`, between the service's bounds; True when the count
    changed, False when it already was that. Raises Http404, PermissionDenied,
    ValidationError (out of bounds) and Conflict (a state that takes no scale, or a count
    changed meanwhile)."""
    _check_may_manage(principal, service)
    if not service.min_replicas <= replicas <= service.max_replicas:
        raise ValidationError(
            {
                "replicas": [
                    f"Between min_replicas ({service.min_replicas}) and max_replicas ({service.max_replicas}); "
                    "stop it, or let it sleep, to go to zero."
                ]
            }
        )
    why = NOT_SCALED.get(service.state) or (
        "a scheduling window holds its replica count" if service.window_action else None
    )
    if why:
        raise Conflict(f"Service {service.pk} cannot be scaled now: {why}.", CoreErrorCode.INVALID_STATE)
    if replicas == service.replicas:
        return False
    by = _who(principal)
    won = scale_service(
        service,
        replicas,
        source="user",
        reason=f"scaled by {by} from {service.replicas} to {replicas}",
        details={"by": by},
    )
    if not won:
        raise Conflict(
            f"Service {service.pk}'s replica count changed meanwhile; read it again and retry.",
            CoreErrorCode.STATUS_CHANGED,
        )
    return True


def stop_service(principal, service: InferenceService) -> InferenceService:
    """A user's stop: every replica stopped (queued ones cancelled), the service
    stopping until they have ended (then stopped, by the rebuild job). Asking again
    while it stops is not an error; a stopped service is a Conflict."""
    _check_may_manage(principal, service)
    for _ in range(3):  # a job may move the state between the read and the CAS
        if move_service(service, sleep.Event.STOP, source="user", reason="stopped by a user"):
            break
        service.refresh_from_db()
    service.refresh_from_db()
    return service


def wake(service: InferenceService, *, source: str, reason: str) -> bool:
    """Wake a sleeping service (its replicas started again, the service waking until one
    is healthy); a service that is awake or waking already is left as it is (True). The
    gateway's path (the job inference.wake_service) and the user's."""
    for _ in range(3):
        if move_service(service, sleep.Event.WAKE, source=source, reason=reason):
            return True
        service.refresh_from_db()
    return False


def wake_service(principal, service: InferenceService) -> InferenceService:
    """A user's wake: from sleeping to waking; a no-op when already awake or waking; a
    Conflict for a paused (its window holds it) or stopped service."""
    _check_may_manage(principal, service)
    wake(service, source="user", reason="woken by a user")
    service.refresh_from_db()
    return service


# --- what the periodic jobs apply (apps.inference.rounds decides, these write) ------------

# the replica statuses a dead node's slot is taken back to the queue from
ON_A_NODE = (TaskStatus.SCHEDULED, TaskStatus.STARTING, TaskStatus.RUNNING)
CRASH_RESTART = "crash_restart"  # in a replica_requeued event's details: a rebuild after a crash


def rebuild_slot(
    service: InferenceService,
    action: rebuild.RebuildAction,
    task_id: int | None,
    status: str | None,
    *,
    node_id: str | None = None,
) -> bool:
    """Apply one rebuild action to the slot `action.rank` (its task `task_id` in `status`,
    or none for a missing rank): a died replica's row requeued (a crash restart marked in
    its event, the crash-loop history), one on a dead node taken back to the queue off it
    (the scheduler places nothing on a given-up node), a missing rank created. Records the
    decision. False when the slot moved meanwhile (nothing done). Conflict quota_exceeded
    when the tenant's quota has no room now (nothing done; the next round tries again)."""
    why = f"rank {action.rank}: {action.reason}"
    with transaction.atomic():
        if action.kind == rebuild.RebuildKind.CREATE:
            locked = _lock(service)
            if locked.state not in (ServiceStatus.STARTING, ServiceStatus.RUNNING) or action.rank >= locked.replicas:
                return False
            if Task.objects.filter(group_id=service.pk, rank=action.rank).exists():
                return False
            group = locked.group
            create_tasks(
                group.tenant, [replica_spec(locked, group, locked.model, action.rank)], created_by=group.created_by
            )
        elif status in REPLICA_REQUEUE_FROM:
            # a crash is a run that ended on its own; a slot stopped on purpose is not one
            crashed = action.counts_as_restart and status in (TaskStatus.FAILED, TaskStatus.COMPLETED)
            details = {"rank": action.rank, CRASH_RESTART: crashed}
            if action.avoid_node:
                details["dead_node"] = action.avoid_node
            if not requeue_replicas([task_id], why=f"rebuilt, {why}", details=details):
                return False
        elif action.kind == rebuild.RebuildKind.RECREATE_ELSEWHERE and status in ON_A_NODE:
            moved = move_tasks([task_id], [status], TaskStatus.PENDING, node=None, host_port=None)
            if not moved:
                return False
            record_events(
                [
                    task_event(
                        task_id,
                        kind="replica_requeued",
                        message=f"rebuilt, {why}",
                        details={"rank": action.rank, CRASH_RESTART: False, "dead_node": action.avoid_node},
                        node_id=node_id,
                    )
                ]
            )
        else:
            return False
        record_decision(service, "rebuild", str(action.kind), why, details={"rank": action.rank, "task_id": task_id})
    return True


def alert_crash_loop(service: InferenceService, task_id: int, node_id: str | None, reason: str) -> bool:
    """The crash-loop alert of one replica slot (one active per slot: its task row), which
    the rebuild recovers once the slot is healthy again. Returns whether it was new."""
    name = service.group.name
    raised = raise_alert(
        type=AlertType.TASK_FAILED,
        severity=Severity.ERROR,
        scope=AlertScope.TASK,
        key=alert_keys.inference_crash_loop(task_id),
        message=f"A replica of inference service {name} is crash-looping ({reason}); it is retried at the "
        "capped back-off.",
        node_id=node_id or "",
        task_id=task_id,
        tenant_id=service.group.tenant_id,
        details={"service_id": service.pk, "cause": "crash_loop"},
    )
    if raised:
        record_decision(service, "rebuild", "crash_loop_alert", reason, details={"task_id": task_id})
    return raised


def apply_window(service: InferenceService, decision: windows.WindowDecision) -> bool:
    """Apply the windows job's decision, in one transaction with the window's memory
    (window_action, window_remembered), by CAS on the count, the state and the memory
    `service` was read with (False: someone changed one first, nothing done):
    pause: the service paused (its replicas stopped) and its count 0; scale: the count set
    (a paused service resumed first when the window switched from pause to scale); stop:
    the service stopped; restore: the remembered count back (a paused service resumed);
    release: the memory dropped. A move its state does not take now (a waking service to
    pause) is left for a later round (False)."""
    move, action = decision.move, decision.action
    if move in (windows.WindowMove.NONE, windows.WindowMove.SKIP):
        return False
    held = str(decision.action) if decision.holds and decision.action else ""
    state = sleep.ServiceState(service.state)
    reason = f"window: {decision.reason}"
    with transaction.atomic():
        won = InferenceService.objects.filter(
            pk=service.pk,
            replicas=service.replicas,
            state=service.state,
            window_action=service.window_action,
        ).update(window_action=held, window_remembered=decision.remember, updated_at=utcnow())
        if not won:
            return False
        if move == windows.WindowMove.APPLY and action == windows.WindowAction.STOP:
            if not sleep.allowed(state, sleep.Event.STOP):
                transaction.set_rollback(True)
                return False
            move_service(service, sleep.Event.STOP, source="window", reason=reason)
        elif move == windows.WindowMove.APPLY and action == windows.WindowAction.PAUSE:
            if state != sleep.ServiceState.PAUSED:
                if not sleep.allowed(state, sleep.Event.PAUSE):
                    transaction.set_rollback(True)
                    return False
                move_service(service, sleep.Event.PAUSE, source="window", reason=reason)
            InferenceService.objects.filter(pk=service.pk).update(replicas=0)
            service.replicas = 0
        elif move == windows.WindowMove.APPLY:  # scale
            _set_count_and_resume(service, decision.replicas, reason)
        elif move == windows.WindowMove.RESTORE:
            _set_count_and_resume(service, decision.replicas, reason)
        else:  # release: the memory only
            record_decision(service, "window", "release", reason)
    service.window_action, service.window_remembered = held, decision.remember
    return True


def _set_count_and_resume(service: InferenceService, replicas: int, reason: str) -> None:
    """The window's count (a paused service: the count, then resumed, which starts the
    slots below it; otherwise a scale)."""
    if service.state == ServiceStatus.PAUSED:
        before = service.replicas
        InferenceService.objects.filter(pk=service.pk).update(replicas=replicas)
        service.replicas = replicas
        move_service(service, sleep.Event.RESUME, source="window", reason=f"{reason} ({before} → {replicas} replicas)")
    elif replicas != service.replicas:
        if not scale_service(service, replicas, source="window", reason=reason):
            raise Conflict("The service's count changed meanwhile.", CoreErrorCode.INVALID_STATE)
