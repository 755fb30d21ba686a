from django.db.models import Count, Exists, OuterRef, Q, Sum

from apps.nodes.choices import ALIVE, NodeStatus
from apps.nodes.models import Gpu, Node
from apps.tasks.choices import ACTIVE
from apps.tasks.models import Task


def gpu_used_by_node(node_ids) -> dict[str, int]:
    """GPUs held by active tasks, for a page of nodes: one grouped query, never a
    subquery per row (which PostgreSQL would evaluate for every row before sorting)."""
    return dict(
        Task.objects.filter(node_id__in=list(node_ids), status__in=ACTIVE)
        .values_list("node_id")
        .annotate(total=Sum("gpu_required"))
    )


def node_list(principal, *, q: str = "", status: str = "", gpu_type: str = ""):
    nodes = Node.objects.visible_to(principal)
    if status:
        nodes = nodes.filter(status=status)
    if gpu_type:
        nodes = nodes.filter(Exists(Gpu.objects.filter(node=OuterRef("pk"), vendor=gpu_type)))
    if q:
        nodes = nodes.filter(
            Q(name__icontains=q) | Q(id__icontains=q) | Q(ip__icontains=q) | Q(internal_ip__icontains=q)
            | Q(rack__icontains=q) | Q(zone__icontains=q) | Q(region__icontains=q) | Q(gpu_model__icontains=q)
            | Exists(Gpu.objects.filter(node=OuterRef("pk"), model__icontains=q))
        )
    return nodes


def environment_summary(principal) -> dict:
    nodes = Node.objects.visible_to(principal)
    by_status = dict(nodes.values_list("status").annotate(n=Count("id")))
    gpus = Gpu.objects.filter(node__in=nodes)
    vendors = dict(gpus.values_list("vendor").annotate(n=Count("id")))
    lost = gpus.filter(lost_at__isnull=False).count()
    total_nodes = sum(by_status.values())
    return {
        "nodes": total_nodes,
        "online_checkable": sum(by_status.get(s, 0) for s in ALIVE),
        "offline": by_status.get(NodeStatus.OFFLINE, 0),
        "by_status": {status: by_status.get(status, 0) for status in NodeStatus.values},
        "gpus": sum(vendors.values()),
        "gpus_lost": lost,
        "gpu_vendors": vendors,
    }
