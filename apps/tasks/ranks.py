"""Rank wiring for task groups: what each worker is told about the others.

At bind the scheduler decides the group's network (`network_decision`: the backend and
whether the workers talk over internal or public addresses, from the spec's proof in
apps.nodes.network, never an IP-prefix guess) and gives rank 0 a host port on its node
(the master's port). At hand-out each member's variables are derived (`rank_env`) from
that decision and the members' nodes in rank order, and laid over the task's own
environment, so a task cannot override them (`wiring_env`)."""

from __future__ import annotations

from collections.abc import Sequence

from apps.tasks.choices import GroupPlacement
from apps.tasks.models import Task

# The variables the platform owns for a member of a group; a task's own env never wins.
RANK_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "HETEROFLOW_DIST_BACKEND",
)

# Each vendor's collective library, used when the nodes are proven to share a network;
# a vendor not listed, or a network not proven the same, gets gloo over TCP.
COLLECTIVE_BACKEND = {
    "nvidia": "nccl",
    "iluvatar": "nccl",
    "amd": "rccl",
    "hygon": "rccl",
    "ascend": "hccl",
    "cambricon": "cncl",
    "kunlun": "bkcl",
    "musa": "mccl",
    "metax": "mccl",
    "enflame": "eccl",
    "biren": "bccl",
}
FALLBACK_BACKEND = "gloo"


# apps.nodes.network's verdicts (NetworkDomain, a StrEnum; nodes sit above tasks)
PROVEN_SAME, PROVEN_DIFFERENT = "proven_same", "proven_different"


def network_decision(
    gpu_type: str, verdict, master_node: str, internal_ip: str | None, public_ip: str | None, master_port: int
) -> dict:
    """The group's network, from apps.nodes.network's verdict (its `domain` and the
    `reason` for it): proven one private network → the master's internal address and the
    vendor's collective library; anything else → its public address and gloo."""
    vendor = gpu_type.lower()
    domain = verdict.domain
    same = domain == PROVEN_SAME and bool(internal_ip)
    if same:
        backend = COLLECTIVE_BACKEND.get(vendor, FALLBACK_BACKEND)
        reason = f"the nodes are proven to share one private network ({verdict.reason}); {backend} for {vendor}"
    else:
        backend = FALLBACK_BACKEND
        why = (
            "the master's node reports no internal address"
            if domain == PROVEN_SAME
            else f"the nodes are proven to be on different networks ({verdict.reason})"
            if domain == PROVEN_DIFFERENT
            else f"the nodes are not proven to share one private network ({verdict.reason})"
        )
        reason = f"{why}: public addresses and gloo"
    return {
        "domain": str(domain),
        "backend": backend,
        "address": "internal" if same else "public",
        "master_node": master_node,
        "master_addr": (internal_ip if same else public_ip) or "",
        "master_port": master_port,
        "reason": reason,
    }


def rank_env(network: dict, rank: int, nodes_by_rank: Sequence[str]) -> dict[str, str]:
    """The variables of the member of this rank, given every member's node in rank order
    (ranks on one node are consecutive; nodes are numbered in the order of their first
    rank, so the master's node is 0)."""
    node = nodes_by_rank[rank]
    node_order = list(dict.fromkeys(nodes_by_rank))
    local = [r for r, here in enumerate(nodes_by_rank) if here == node]
    return {
        "WORLD_SIZE": str(len(nodes_by_rank)),
        "RANK": str(rank),
        "LOCAL_RANK": str(local.index(rank)),
        "NODE_RANK": str(node_order.index(node)),
        "LOCAL_WORLD_SIZE": str(len(local)),
        "MASTER_ADDR": str(network.get("master_addr", "")),
        "MASTER_PORT": str(network.get("master_port", "")),
        "HETEROFLOW_DIST_BACKEND": str(network.get("backend", FALLBACK_BACKEND)),
    }


def wiring_env(task: Task) -> dict[str, str]:
    """A bound member's rank variables ({} for a task outside a group, a replica of an
    inference service, or a group not bound yet)."""
    if task.group_id is None or task.node_id is None or task.group.placement != GroupPlacement.GANG:
        return {}
    network = task.group.network or {}
    nodes = list(
        Task.objects.filter(group_id=task.group_id).exclude(node=None).order_by("rank").values_list("rank", "node_id")
    )
    if not network or [rank for rank, _ in nodes] != list(range(task.group.world_size)):
        return {}
    return rank_env(network, task.rank, [node for _, node in nodes])
