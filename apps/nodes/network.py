"""Whether a group of nodes shares one private network.

Private addresses are unique only inside one VPC, so guessing from IP prefixes sends
NCCL to an internal MASTER_ADDR that hangs forever, silently. The rule: first look for
proof that they differ (a duplicated internal IP, different regions, two different
values of one declared label), then for proof that they are the same (every node
declares the same `heteroflow.network_zone`, or every node the same `heteroflow.vpc_id`);
anything else is unknown, and the caller falls back to public addresses (gloo).
`assume_same` restores the old behaviour for deployments known to be one VPC, except
where difference is proven.

The two labels: `heteroflow.network_zone` is the operator's declaration ("these nodes
reach each other privately"; the cloud's VPC ID is the recommended value);
`heteroflow.vpc_id` is the VPC the agent (or the operator) reports from the cloud's
instance metadata. Either one, agreeing on every node, proves the same network; a
disagreement in either proves different networks (peered VPCs report different VPC
IDs: they get public addresses and gloo, slower but never a silent hang).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

ZONE_LABEL = "heteroflow.network_zone"
VPC_LABEL = "heteroflow.vpc_id"
# the labels that declare a node's private network, each read on its own
DOMAIN_LABELS = (ZONE_LABEL, VPC_LABEL)


class NetworkDomain(enum.StrEnum):
    PROVEN_SAME = "proven_same"
    PROVEN_DIFFERENT = "proven_different"
    UNKNOWN = "unknown"


def same_network_domain(nodes: Iterable, policy: str = "prove") -> NetworkDomain:
    nodes = list(nodes)
    if policy not in ("prove", "assume_same"):
        raise ValueError(f"unknown network domain policy {policy!r}")
    if len(nodes) <= 1:
        return NetworkDomain.PROVEN_SAME
    internal_ips = [node.internal_ip for node in nodes if node.internal_ip]
    if len(internal_ips) != len(set(internal_ips)):
        return NetworkDomain.PROVEN_DIFFERENT
    regions = {node.region for node in nodes if node.region}
    if len(regions) > 1:
        return NetworkDomain.PROVEN_DIFFERENT
    declared_everywhere = False
    for label in DOMAIN_LABELS:
        values = [str((node.labels or {}).get(label) or "").strip() for node in nodes]
        declared = {value for value in values if value}
        if len(declared) > 1:
            return NetworkDomain.PROVEN_DIFFERENT
        declared_everywhere |= len(declared) == 1 and all(values)
    if declared_everywhere:
        return NetworkDomain.PROVEN_SAME
    return NetworkDomain.PROVEN_SAME if policy == "assume_same" else NetworkDomain.UNKNOWN
