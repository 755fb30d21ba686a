"""Submitting a task: what POST /api/v1/tasks and the portal's task form both do with
the data TaskCreateSerializer validated (the tenant, the role, the tenant's secrets, the
default timeout), before services.create_task. One place, so both say the same. An
array (POST /api/v1/tasks/batch) is checked the same way once, then created N times; so
is a task group (POST /api/v1/task-groups), then created as its world_size members."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django_tenants.utils import schema_context
from rest_framework.exceptions import ValidationError

from apps.confidential.models import Secret
from apps.confidential.services import record_audit
from apps.core.error_codes import CoreErrorCode
from apps.core.errors import Conflict
from apps.tasks import services
from apps.tasks.choices import MAX_TASK_SECONDS, TaskKind, TaskStatus
from apps.tasks.models import Task, TaskGroup
from apps.tenants import policy
from apps.tenants.models import Tenant


def check_secrets(tenant: Tenant, env: dict, registry_auth: dict | None) -> None:
    """Every secret the task references must exist in the tenant's own schema."""
    wanted = {("env", value["secret"]) for value in env.values() if isinstance(value, dict)}
    if registry_auth:
        wanted.add(("registry_auth", registry_auth["password"]["secret"]))
    if not wanted:
        return
    with schema_context(tenant.schema_name):
        known = set(Secret.objects.filter(name__in={name for _, name in wanted}).values_list("name", flat=True))
    problems: dict[str, list[str]] = {}
    for field, name in sorted(wanted):
        if name not in known:
            problems.setdefault(field, []).append(f"No secret named {name!r} in tenant '{tenant.slug}'.")
    if problems:
        raise ValidationError(problems)


def prepared(principal, validated: dict) -> tuple[Tenant, dict]:
    """The tenant a submission acts for and the task's fields, once the caller may create
    tasks there and the secrets it names exist."""
    data = dict(validated)
    tenant = policy.acting_tenant(
        principal, data.pop("tenant", None), required="Required: the slug of the tenant the task runs for."
    )
    policy.check_may_create_tasks(principal, tenant)
    check_secrets(tenant, data["env"], data.get("registry_auth"))
    hours = data.pop("max_hours", None)
    if data.get("kind") == TaskKind.INTERACTIVE:
        interactive_limits(tenant, data, hours)
    if "timeout_seconds" not in data:
        data["timeout_seconds"] = settings.HETEROFLOW_TASK_TIMEOUT_SECONDS
    declared = data.get("max_duration_seconds")
    if declared is not None and declared > data["timeout_seconds"]:
        raise ValidationError(
            {
                "max_duration_seconds": [
                    f"At most the timeout ({data['timeout_seconds']} s): it is stopped by then anyway."
                ]
            }
        )
    return tenant, data


def interactive_limits(tenant: Tenant, data: dict, hours: float | None) -> None:
    """An interactive task's times (docs/interactive.md): its idle time (the tenant's
    default where it names none, never past the tenant's ceiling), and how long it runs
    (max_hours, or the platform's), which is its timeout too unless it names one."""
    ceiling = tenant.interactive_idle_minutes_max or settings.HETEROFLOW_INTERACTIVE_IDLE_MINUTES_MAX
    idle = data.get("idle_minutes") or tenant.interactive_idle_minutes or settings.HETEROFLOW_INTERACTIVE_IDLE_MINUTES
    if idle > ceiling:
        if data.get("idle_minutes"):
            raise ValidationError({"idle_minutes": [f"At most {ceiling} minutes in tenant '{tenant.slug}'."]})
        idle = ceiling
    data["idle_minutes"] = idle
    if data.get("max_duration_seconds") is None:
        data["max_duration_seconds"] = round((hours or settings.HETEROFLOW_INTERACTIVE_MAX_HOURS) * 3600)
    data.setdefault("timeout_seconds", min(data["max_duration_seconds"], MAX_TASK_SECONDS))


def submit_task(principal, validated: dict) -> Task:
    """Queue a task from TaskCreateSerializer's validated data. Raises ValidationError
    (400), PermissionDenied (403), Http404 and Conflict (409, quota) as the API answers."""
    tenant, data = prepared(principal, validated)
    task = services.create_task(tenant=tenant, created_by=principal.user, **data)
    # after the create's commit: its tenant lock is not held through one more insert
    record_audit(tenant, principal, "task.created", str(task.pk), name=task.name)
    return task


def resubmit_task(principal, task: Task, validated: dict, change: dict) -> Task:
    """Queue `task` again with `change` (its submission with those fields replaced,
    validated as a create) and cancel it, in one transaction: both happen or neither
    does (a refused create leaves the task waiting). Each records the other in its
    events, and the audit records the new task. Raises what submit_task raises, and
    Conflict (409) when the task is no longer waiting."""
    policy.check_may_stop_task(principal, task)
    tenant, data = prepared(principal, validated)
    with transaction.atomic():
        if not services.move_tasks([task.pk], (TaskStatus.PENDING,), TaskStatus.CANCELLED):
            task.refresh_from_db(fields=["status"])
            raise Conflict(
                f"Task {task.pk} is {task.status}, no longer waiting; nothing changed.", CoreErrorCode.STATUS_CHANGED
            )
        new = services.create_task(tenant=tenant, created_by=principal.user, **data)
        services.record_event(
            task,
            kind="resubmitted",
            message=f"cancelled: resubmitted as task {new.pk} with {format_change(change)}",
            details={"as": new.pk, "change": change},
        )
        services.record_event(
            new,
            kind="resubmitted_from",
            message=f"task {task.pk} resubmitted with {format_change(change)}",
            details={"from": task.pk, "change": change},
        )
    record_audit(tenant, principal, "task.resubmitted", str(new.pk), name=new.name, resubmitted_from=task.pk)
    return new


def format_change(change: dict) -> str:
    return ", ".join(f"{field}={value!r}" for field, value in change.items()) or "no change"


def submit_array(principal, validated: dict) -> list[Task]:
    """Queue an array from TaskArraySerializer's validated data: `array.count` copies of
    the task, indices 0…count-1, all or none against the quota. Raises as submit_task."""
    data = dict(validated)
    count = data.pop("array")["count"]
    tenant, fields = prepared(principal, data)
    specs = [{**fields, "array_index": index, "array_size": count} for index in range(count)]
    tasks = services.create_tasks(tenant, specs, created_by=principal.user)
    record_audit(
        tenant, principal, "task_array.created", f"{tasks[0].pk}-{tasks[-1].pk}", name=fields["name"], count=count
    )
    return tasks


def submit_group(principal, validated: dict) -> TaskGroup:
    """Queue a task group from TaskGroupCreateSerializer's validated data: checked as a
    task is (the tenant, the role, the secrets its env names, the default timeout for its
    members), then services.create_group, all or nothing against the quota. Raises as
    submit_task."""
    tenant, data = prepared(principal, validated)
    group = services.create_group(tenant, data, created_by=principal.user)
    record_audit(tenant, principal, "task_group.created", str(group.pk), name=group.name, kind=group.kind)
    return group
