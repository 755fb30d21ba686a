"""Reads of the model registry shared by the API and the portal.

Where a model is cached is joined, not stored: a node caches a model when its own reports
name it (apps.nodes.model_cache reads them):
- a discovered model (`discovered_models`, the agent's disk scan and what its running
  inference containers serve) whose name is the model's name, or whose path is the
  model's source path (a `path` model; trailing slashes ignored);
- an entry of the node's `heteroflow.cache/models` label that is the model's name or its
  source (the path of a `path` model, the hub id of a `hub` model).
Only nodes the model's tenant may use count (shared ones and its dedicated ones): a
node dedicated to another tenant is never shown, whoever asks."""

from __future__ import annotations

from django.db.models import Q

from apps.inference.models import InferenceService, LoanState, Model, ServiceLoan
from apps.nodes.model_cache import found_on, may_hold
from apps.nodes.models import Node
from apps.tasks.choices import TaskStatus
from apps.tasks.models import Task


def model_list(models, *, format: str = "", engine: str = ""):
    """Models filtered in SQL: by format, and by an engine among those that can serve them."""
    if format:
        models = models.filter(format=format)
    if engine:
        models = models.filter(engines__contains=[engine])
    return models.select_related("tenant").prefetch_related("nodes")


def how_cached(model: Model, node) -> dict | None:
    """How `node` holds `model` (apps.nodes.model_cache.found_on): the paths its scan found
    it at, whether the label lists it, and the inference tasks whose engine has it loaded
    (the agent marks those entries `served`); None when it does not hold it."""
    matches, labelled = found_on(model, node)
    if not matches and not labelled:
        return None
    return {
        "node_id": node.pk,
        "node_name": node.name,
        "status": node.status,
        "paths": sorted({m["path"] for m in matches if m["path"]}),
        "labelled": labelled,
        "served_by_tasks": sorted({m["task_id"] for m in matches if m["task_id"] is not None}),
    }


def cached_on(models) -> dict[int, list[dict]]:
    """model id -> the nodes that cache it (how_cached's dicts, by node name). One query
    for the nodes, whatever the number of models."""
    models = list(models)
    found: dict[int, list[dict]] = {model.pk: [] for model in models}
    if not models:
        return found
    tenants = {model.tenant_id for model in models}
    nodes = (
        may_hold(Node.objects.filter(Q(tenant__isnull=True) | Q(tenant__in=tenants)), models)
        .only("id", "name", "status", "tenant_id", "discovered_models", "labels")
        .order_by("name", "id")
    )
    for node in nodes:
        for model in models:
            if node.tenant_id not in (None, model.tenant_id):
                continue
            held = how_cached(model, node)
            if held:
                found[model.pk].append(held)
    return found


def registered_on(node) -> list[Model]:
    """The models registered (pinned) on `node`, of every tenant, by tenant and name."""
    return list(Model.objects.filter(nodes=node).select_related("tenant").order_by("tenant__slug", "name", "id"))


# --- inference services: their replicas ------------------------------------------------------


def node_address(ip: str | None, port: int | None) -> str | None:
    """`http://<ip>:<port>` (an IPv6 address in brackets), or None without either."""
    if not ip or not port:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def health_by_task(task_health) -> dict[int, bool]:
    """A node's latest task_health report ([{"task_id", "healthy"}]) as task id -> healthy;
    malformed entries are skipped."""
    found: dict[int, bool] = {}
    for entry in task_health or []:
        if isinstance(entry, dict) and isinstance(entry.get("task_id"), int):
            found[entry["task_id"]] = bool(entry.get("healthy"))
    return found


REPLICA_COLUMNS = (
    "pk",
    "group_id",
    "rank",
    "status",
    "node_id",
    "node__ip",
    "node__task_health",
    "node__last_heartbeat_at",
    "host_port",
    "started_at",
    "finished_at",
    "gpu_required",
)


def replica_rows(service_ids) -> dict[int, list[dict]]:
    """service id -> its replicas in rank order (replicas_of's rows, plus what the jobs
    read: group_id, node_last_heartbeat_at, finished_at, gpu_required), for any number of
    services in one query."""
    found: dict[int, list[dict]] = {pk: [] for pk in service_ids}
    if not found:
        return found
    rows = Task.objects.filter(group_id__in=list(found)).order_by("group_id", "rank").values_list(*REPLICA_COLUMNS)
    for pk, group_id, rank, status, node_id, ip, task_health, heartbeat, port, started, finished, gpus in rows:
        running = status == TaskStatus.RUNNING
        reported = health_by_task(task_health).get(pk) if node_id else None
        healthy = (reported if reported is not None else None) if running else False
        found[group_id].append(
            {
                "task_id": pk,
                "rank": rank,
                "status": status,
                "node_id": node_id,
                "node_address": ip if node_id else None,
                "host_port": port,
                "healthy": healthy,
                "address": node_address(ip, port) if node_id else None,
                "started_at": started,
                "finished_at": finished,
                "node_last_heartbeat_at": heartbeat,
                "gpu_required": gpus,
            }
        )
    return found


def replicas_of(service: InferenceService) -> list[dict]:
    """The service's replicas in rank order, each: task_id, rank, status, node_id,
    node_address (the node's reported IP), host_port, healthy (True or False from the
    node's latest health report while the task runs, False when it does not run, None
    while its node has not reported on it), address (`http://ip:port`, what the gateway
    calls, or None off a node or without a port) and started_at."""
    keep = ("task_id", "rank", "status", "node_id", "node_address", "host_port", "healthy", "address", "started_at")
    return [{key: row[key] for key in keep} for row in replica_rows([service.pk])[service.pk]]


def loan_rows(loans) -> list[dict]:
    """Loans as the explain API, `hf explain` and the portal show them."""
    return [
        {
            "loan_id": loan.pk,
            "service_id": loan.service_id,
            "name": loan.service.group.name,
            "borrower_id": loan.borrower_id,
            "borrower": loan.borrower.name,
            "borrower_group_id": loan.borrower_group_id,
            "node_id": loan.node_id,
            "replicas": loan.from_replicas - loan.to_replicas,
            "sleeps": loan.sleeps,
            "state": loan.state,
            "since": loan.created_at.isoformat(),
            "returned_at": loan.returned_at.isoformat() if loan.returned_at else None,
            "returned_why": loan.returned_why,
        }
        for loan in loans
    ]


def open_loans_of_task(task_id: int) -> list[dict]:
    """The open loans a training task borrows from (one per lending service)."""
    loans = ServiceLoan.objects.filter(borrower_id=task_id, state=LoanState.OPEN)
    return loan_rows(loans.select_related("service__group", "borrower").order_by("service_id"))


def open_loans_of_group(group_id: int) -> list[dict]:
    """The open loans a training task group borrows from (one per lending service)."""
    loans = ServiceLoan.objects.filter(borrower_group_id=group_id, state=LoanState.OPEN)
    return loan_rows(loans.select_related("service__group", "borrower").order_by("service_id"))


def loans_of_service(service: InferenceService, limit: int = 10) -> list[dict]:
    """The service's latest loans, open ones first (the service page)."""
    loans = ServiceLoan.objects.filter(service=service).select_related("service__group", "borrower")
    return loan_rows(loans.order_by("state", "-created_at", "-id")[:limit])
