"""Whether a group of nodes shares one private network.

Private addresses are unique only inside one VPC, so guessing from IP prefixes sends
NCCL to an internal MASTER_ADDR that hangs forever, silently. The rule: first look for
proof that they differ (a duplicated internal IP, different regions, different declared
zones), then for proof that they are the same (every node declares the same
`heteroflow.network_zone`); anything else is unknown, and the caller falls back to
public addresses (gloo). `assume_same` restores the old behaviour for deployments known
to be one VPC, except where difference is proven.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

ZONE_LABEL = "heteroflow.network_zone"


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
    zones = [(node.labels or {}).get(ZONE_LABEL, "").strip() for node in nodes]
    declared = {zone for zone in zones if zone}
    if len(declared) > 1:
        return NetworkDomain.PROVEN_DIFFERENT
    if len(declared) == 1 and all(zones):
        return NetworkDomain.PROVEN_SAME
    return NetworkDomain.PROVEN_SAME if policy == "assume_same" else NetworkDomain.UNKNOWN
