from types import SimpleNamespace

import pytest

from apps.nodes.network import NetworkDomain, same_network_domain


def node(internal_ip="", region="", zone=None):
    labels = {"heteroflow.network_zone": zone} if zone is not None else {}
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
    ],
)
def test_network_domain_proof(nodes, policy, expected):
    assert same_network_domain(nodes, policy) == expected


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError):
        same_network_domain([node(), node()], "guess")
