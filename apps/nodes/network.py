"""Whether a group of nodes shares one private network.

Private addresses are unique only inside one VPC, so a wrong guess sends NCCL to an
internal MASTER_ADDR that hangs forever, silently. The rule: first look for proof that
they differ (one internal IP on two hosts, different regions, two different values of
one declared label), then for proof that they are the same (every node declares the same
`heteroflow.network_zone`, or every node the same `heteroflow.vpc_id`; or, with no
label saying otherwise, every node's internal address is in one subnet as its own
interface reports it: address and prefix length); anything else is unknown, and the
caller falls back to public addresses (gloo). `labels` keeps to the labels (for fleets
whose VPCs reuse one address plan); `assume_same` restores the old behaviour for
deployments known to be one VPC, except where difference is proven.

The two labels: `heteroflow.network_zone` is the operator's declaration ("these nodes
reach each other privately"; the cloud's VPC ID is the recommended value);
`heteroflow.vpc_id` is the VPC the agent (or the operator) reports from the cloud's
instance metadata. Either one, agreeing on every node, proves the same network; a
disagreement in either proves different networks (peered VPCs report different VPC
IDs: they get public addresses and gloo, slower but never a silent hang).
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable
from typing import NamedTuple

ZONE_LABEL = "heteroflow.network_zone"
VPC_LABEL = "heteroflow.vpc_id"
# the labels that declare a node's private network, each read on its own
DOMAIN_LABELS = (ZONE_LABEL, VPC_LABEL)
POLICIES = ("prove", "labels", "assume_same")
# what the rule reads of each node (the bind loads only these)
NODE_FIELDS = ("id", "ip", "internal_ip", "internal_prefix", "mac", "hostname", "region", "labels")


class NetworkDomain(enum.StrEnum):
    PROVEN_SAME = "proven_same"
    PROVEN_DIFFERENT = "proven_different"
    UNKNOWN = "unknown"


class DomainVerdict(NamedTuple):
    domain: NetworkDomain
    reason: str  # why, in words, for the group's network decision


def same_network_domain(nodes: Iterable, policy: str = "prove") -> DomainVerdict:
    nodes = list(nodes)
    if policy not in POLICIES:
        raise ValueError(f"unknown network domain policy {policy!r}")
    if len(nodes) <= 1:
        return DomainVerdict(NetworkDomain.PROVEN_SAME, "one node")
    different = proof_of_difference(nodes)
    if different:
        return DomainVerdict(NetworkDomain.PROVEN_DIFFERENT, different)
    declared = declared_domain(nodes)
    if declared:
        return DomainVerdict(NetworkDomain.PROVEN_SAME, declared)
    if policy == "prove":
        subnet = shared_subnet(nodes)
        if subnet:
            return DomainVerdict(NetworkDomain.PROVEN_SAME, f"every node's interface is in {subnet}")
    if policy == "assume_same":
        return DomainVerdict(NetworkDomain.PROVEN_SAME, "assumed one network (policy assume_same)")
    return DomainVerdict(NetworkDomain.UNKNOWN, unproven(nodes, policy))


def proof_of_difference(nodes: list) -> str:
    """Why the nodes are on different networks, or "" when nothing proves it."""
    hosts_by_ip: dict[str, tuple | None] = {}
    for node in nodes:
        if not node.internal_ip:
            continue
        host = same_host_key(node)
        if node.internal_ip in hosts_by_ip and (host is None or hosts_by_ip[node.internal_ip] != host):
            return f"internal address {node.internal_ip} is reported by two hosts: two networks reuse it"
        hosts_by_ip[node.internal_ip] = host
    regions = sorted({node.region for node in nodes if node.region})
    if len(regions) > 1:
        return f"the nodes are in different regions ({', '.join(regions)})"
    for label in DOMAIN_LABELS:
        values = sorted({label_value(node, label) for node in nodes} - {""})
        if len(values) > 1:
            return f"the nodes declare different {label} ({', '.join(values)})"
    return ""


def same_host_key(node) -> tuple | None:
    """Two agents on one machine (one node each) share its address; they are the same
    host when both report the same MAC and hostname. None: the node can't be told apart
    from another host (no MAC reported)."""
    mac = (getattr(node, "mac", "") or "").lower()
    return (mac, getattr(node, "hostname", "") or "") if mac else None


def declared_domain(nodes: list) -> str:
    """The label every node declares with one value, as the reason; "" when none is."""
    for label in DOMAIN_LABELS:
        values = [label_value(node, label) for node in nodes]
        if all(values) and len(set(values)) == 1:
            return f"every node declares {label}={values[0]}"
    return ""


def shared_subnet(nodes: list) -> str:
    """The one subnet every node's internal address is in, by each node's own prefix
    length (the agent reads it from the interface); "" when a node reports no address or
    no prefix (an older agent), or the subnets differ."""
    networks = set()
    for node in nodes:
        prefix = getattr(node, "internal_prefix", None)
        if not node.internal_ip or prefix is None:
            return ""
        try:
            networks.add(ipaddress.ip_interface(f"{node.internal_ip}/{prefix}").network)
        except ValueError:
            return ""
    return str(networks.pop()) if len(networks) == 1 else ""


def unproven(nodes: list, policy: str) -> str:
    if policy == "labels":
        return f"no {ZONE_LABEL} or {VPC_LABEL} declared alike on every node (policy labels)"
    if any(not node.internal_ip or getattr(node, "internal_prefix", None) is None for node in nodes):
        return "no label declared alike on every node, and not every node reports its internal address and prefix"
    return "no label declared alike on every node, and the nodes' interfaces are in different subnets"


def label_value(node, label: str) -> str:
    return str((node.labels or {}).get(label) or "").strip()
