from types import SimpleNamespace

import pytest

from apps.nodes.network import VPC_LABEL, ZONE_LABEL, NetworkDomain, same_network_domain


def node(internal_ip="", region="", zone=None, vpc=None):
    labels = {ZONE_LABEL: zone} if zone is not None else {}
    if vpc is not None:
        labels[VPC_LABEL] = vpc
    return SimpleNamespace(internal_ip=internal_ip, region=region, labels=labels)


@pytest.mark.parametrize(
    "nodes,policy,expected",
    [
        ([node("10.0.0.1", zone="vpc-a")], "prove", NetworkDomain.PROVEN_SAME),
        ([node("10.0.0.1", zone="vpc-a"), node("10.0.0.2", zone="vpc-a")], "prove", NetworkDomain.PROVEN_SAME),
        # duplicated internal IP: two VPCs, whatever the labels claim
        ([node("10.0.0.1", zone="vpc-a"), node("10.0.0.1", zone="vpc-a")], "prove", NetworkDomain.PROVEN_DIFFERENT),
        (
            [node("10.0.0.1", zone="vpc-a"), node("10.0.0.1", zone="vpc-a")],
            "assume_same",
            NetworkDomain.PROVEN_DIFFERENT,
        ),
        (
            [node("10.0.0.1", "cn-north", "z"), node("10.0.0.2", "cn-east", "z")],
            "prove",
            NetworkDomain.PROVEN_DIFFERENT,
        ),
        ([node("10.0.0.1", zone="vpc-a"), node("10.0.0.2", zone="vpc-b")], "prove", NetworkDomain.PROVEN_DIFFERENT),
        # same subnet by prefix proves nothing
        ([node("10.0.0.1"), node("10.0.0.2")], "prove", NetworkDomain.UNKNOWN),
        ([node("10.0.0.1", zone="vpc-a"), node("10.0.0.2")], "prove", NetworkDomain.UNKNOWN),
        ([node("10.0.0.1", zone="vpc-a"), node("10.0.0.2", zone="  ")], "prove", NetworkDomain.UNKNOWN),
        ([node("10.0.0.1"), node("10.0.0.2")], "assume_same", NetworkDomain.PROVEN_SAME),
        ([node(), node()], "prove", NetworkDomain.UNKNOWN),
        # heteroflow.vpc_id, as the agent reports it: agreeing on every node proves the same network
        ([node("10.0.0.1", vpc="vpc-1"), node("10.0.0.2", vpc="vpc-1")], "prove", NetworkDomain.PROVEN_SAME),
        ([node("10.0.0.1", vpc="vpc-1"), node("10.0.0.2", vpc="vpc-2")], "prove", NetworkDomain.PROVEN_DIFFERENT),
        ([node("10.0.0.1", vpc="vpc-1"), node("10.0.0.2", vpc="vpc-2")], "assume_same", NetworkDomain.PROVEN_DIFFERENT),
        ([node("10.0.0.1", vpc="vpc-1"), node("10.0.0.2")], "prove", NetworkDomain.UNKNOWN),
        # either label declared on every node is enough; the other may be partial
        ([node("10.0.0.1", zone="z", vpc="vpc-1"), node("10.0.0.2", vpc="vpc-1")], "prove", NetworkDomain.PROVEN_SAME),
        ([node("10.0.0.1", zone="z", vpc="vpc-1"), node("10.0.0.2", zone="z")], "prove", NetworkDomain.PROVEN_SAME),
        # one label agreeing does not outweigh the other disagreeing
        (
            [node("10.0.0.1", zone="z", vpc="vpc-1"), node("10.0.0.2", zone="z", vpc="vpc-2")],
            "prove",
            NetworkDomain.PROVEN_DIFFERENT,
        ),
        # duplicated internal IP beats agreeing VPC IDs
        ([node("10.0.0.1", vpc="vpc-1"), node("10.0.0.1", vpc="vpc-1")], "prove", NetworkDomain.PROVEN_DIFFERENT),
    ],
)
def test_network_domain_proof(nodes, policy, expected):
    assert same_network_domain(nodes, policy) == expected


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError):
        same_network_domain([node(), node()], "guess")
