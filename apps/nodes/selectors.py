from django.db.models import Count, Exists, OuterRef, Q

from apps.nodes.choices import ALIVE, NodeStatus
from apps.nodes.models import Gpu, Node


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
