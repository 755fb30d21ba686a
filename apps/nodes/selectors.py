from django.db.models import Avg, Count, Exists, F, OuterRef, Q, Subquery
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce

from apps.nodes.choices import ALIVE, NodeStatus, is_dirty_build
from apps.nodes.models import Gpu, Node
from apps.scheduler.models import GpuAllocation
from apps.tasks.choices import ACTIVE
from apps.tasks.models import Task


def node_list(principal, *, q: str = "", status: str = "", gpu_type: str = ""):
    nodes = Node.objects.visible_to(principal)
    if status:
        nodes = nodes.filter(status=status)
    if gpu_type:
        nodes = nodes.filter(Exists(Gpu.objects.filter(node=OuterRef("pk"), vendor=gpu_type)))
    if q:
        pattern = "%" + like_escaped(q.upper()) + "%"
        nodes = nodes.filter(pk__in=RawSQL(NODE_SEARCH_SQL, [pattern, pattern]))
    return nodes


# The node search (`?q=`): a case-insensitive substring of the name, id, addresses,
# location or GPU model, read from `node_search` (migration nodes/0007: those fields
# upper-cased and joined by a unit separator, kept by triggers on nodes) through its
# trigram index where PostgreSQL has pg_trgm. A node's gpu_model is its cards' model, normalised as each
# card's, or "mixed": only the cards of a mixed node (or of one that never beat) are
# searched one by one.
NODE_SEARCH_SQL = (
    "SELECT node_id FROM node_search WHERE text LIKE %s "
    "UNION SELECT g.node_id FROM gpus g JOIN nodes n ON n.id = g.node_id "
    "WHERE n.gpu_model IN ('mixed', '') AND upper(g.model) LIKE %s"
)


def like_escaped(text: str) -> str:
    """`text` matched literally by LIKE (its default escape character is the backslash)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_").replace("\x1f", "")


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


# --- the portal's node pages (the API lists nodes through presenters) ----------------------

# The orders the node page offers; each is computed in SQL so a page reads only its rows.
NODE_SORTS = {
    "tasks": ("-active_tasks", "name", "id"),  # the default: where the work is
    "busy": ("-gpus_busy", "name", "id"),  # GPUs held by tasks
    "utilization": (F("gpu_utilization").desc(nulls_last=True), "name", "id"),
    "name": ("name", "id"),
}


def with_load(nodes):
    """Each node with its active tasks, GPUs held (cards in the ledger) and mean GPU
    utilisation: three correlated subqueries, evaluated only for the rows returned."""
    active = Task.objects.filter(node=OuterRef("pk"), status__in=ACTIVE).order_by().values("node")
    held = GpuAllocation.objects.filter(node=OuterRef("node"), gpu_index=OuterRef("index"))
    busy = (
        Gpu.objects.filter(Exists(held), node=OuterRef("pk"), lost_at__isnull=True)
        .order_by()
        .values("node")
        .annotate(n=Count("id"))
        .values("n")
    )
    utilisation = (
        Gpu.objects.filter(node=OuterRef("pk"), lost_at__isnull=True)
        .order_by()
        .values("node")
        .annotate(avg=Avg("utilization"))
        .values("avg")
    )
    return nodes.annotate(
        active_tasks=Coalesce(Subquery(active.annotate(n=Count("id")).values("n")), 0),
        gpus_busy=Coalesce(Subquery(busy), 0),
        gpu_utilization=Subquery(utilisation),
    )


def node_cards(principal, *, q: str = "", sort: str = "tasks"):
    """The node page's cards, in one of NODE_SORTS; paginate before evaluating."""
    return with_load(node_list(principal, q=q)).order_by(*NODE_SORTS.get(sort, NODE_SORTS["tasks"]))


def gpu_summary(principal) -> dict:
    """The node page's strip: every card of the visible nodes, as busy (held by a task),
    idle or lost. A lost card still counts in the total, never as busy or idle."""
    gpus = Gpu.objects.filter(node__in=Node.objects.visible_to(principal))
    counts = gpus.with_state().aggregate(
        total=Count("id"),
        lost=Count("id", filter=Q(lost_at__isnull=False)),
        busy=Count("id", filter=Q(lost_at__isnull=True, held=True)),
    )
    counts["idle"] = counts["total"] - counts["lost"] - counts["busy"]
    return counts


def gpus_online(principal) -> int:
    """The status bar's "GPUs online": cards not lost on visible nodes that are online."""
    return Gpu.objects.filter(
        node__in=Node.objects.visible_to(principal).filter(status=NodeStatus.ONLINE), lost_at__isnull=True
    ).count()


def nodes_by_liveness(principal, tab: str):
    """The environment page's tabs: alive (answers, checkable), offline, or all."""
    nodes = Node.objects.visible_to(principal)
    if tab == "alive":
        return nodes.filter(status__in=ALIVE)
    if tab == "offline":
        return nodes.filter(status=NodeStatus.OFFLINE)
    return nodes


def agent_fleet(principal) -> dict:
    """The agent versions the visible nodes run, most nodes first: per version the nodes
    (and how many are alive) and the commits it was built from, "-dirty" builds marked.
    More than one reported version is a mismatch; nodes that never reported one (no beat
    yet) are listed apart and do not make one."""
    rows = (
        Node.objects.visible_to(principal)
        .order_by()
        .values_list("agent_version", "agent_git_commit")
        .annotate(nodes=Count("id"), alive=Count("id", filter=Q(status__in=ALIVE)))
    )
    versions: dict[str, dict] = {}
    for version, commit, nodes, alive in rows:
        row = versions.setdefault(version, {"version": version, "nodes": 0, "alive": 0, "commits": []})
        row["nodes"] += nodes
        row["alive"] += alive
        row["commits"].append({"commit": commit, "nodes": nodes, "dirty": is_dirty_build(commit)})
    listed = sorted(versions.values(), key=lambda row: (row["version"] == "", -row["nodes"], row["version"]))
    for row in listed:
        row["commits"].sort(key=lambda commit: (-commit["nodes"], commit["commit"]))
    reported = sum(1 for row in listed if row["version"])
    return {
        "versions": listed,
        "reported_versions": reported,
        "mismatch": reported > 1,
        "dirty_nodes": sum(commit["nodes"] for row in listed for commit in row["commits"] if commit["dirty"]),
    }
