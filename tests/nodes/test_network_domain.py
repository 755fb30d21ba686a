from types import SimpleNamespace

import pytest

from apps.nodes.network import VPC_LABEL, ZONE_LABEL, NetworkDomain, same_network_domain


def node(internal_ip="", region="", zone=None, vpc=None, prefix=None, mac="", hostname=""):
    labels = {ZONE_LABEL: zone} if zone is not None else {}
    if vpc is not None:
        labels[VPC_LABEL] = vpc
    return SimpleNamespace(
        internal_ip=internal_ip, internal_prefix=prefix, region=region, labels=labels, mac=mac, hostname=hostname
    )


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
        # addresses alone (no prefix: an older agent) prove nothing
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
    verdict = same_network_domain(nodes, policy)
    assert verdict.domain == expected and verdict.reason


@pytest.mark.parametrize(
    "nodes,policy,expected,reason",
    [
        # one subnet, as each interface reports it, proves one network when no label says otherwise
        (
            [node("10.0.0.1", prefix=24), node("10.0.0.2", prefix=24)],
            "prove",
            NetworkDomain.PROVEN_SAME,
            "10.0.0.0/24",
        ),
        (
            [node("10.0.0.1", prefix=16), node("10.0.7.2", prefix=16), node("10.0.200.9", prefix=16)],
            "prove",
            NetworkDomain.PROVEN_SAME,
            "10.0.0.0/16",
        ),
        # a partial label does not stop the subnet rule
        (
            [node("10.0.0.1", prefix=24, zone="z"), node("10.0.0.2", prefix=24)],
            "prove",
            NetworkDomain.PROVEN_SAME,
            "10.0.0.0/24",
        ),
        # different subnets (routed, or two VPCs): not proven
        ([node("10.0.0.1", prefix=24), node("10.0.1.2", prefix=24)], "prove", NetworkDomain.UNKNOWN, "subnets"),
        # the same address block seen through different prefixes is two subnets
        ([node("10.0.0.1", prefix=24), node("10.0.0.2", prefix=16)], "prove", NetworkDomain.UNKNOWN, "subnets"),
        # one node without a prefix (an older agent): not proven
        ([node("10.0.0.1", prefix=24), node("10.0.0.2")], "prove", NetworkDomain.UNKNOWN, "prefix"),
        # labels that disagree win over a shared subnet
        (
            [node("10.0.0.1", prefix=24, zone="a"), node("10.0.0.2", prefix=24, zone="b")],
            "prove",
            NetworkDomain.PROVEN_DIFFERENT,
            "heteroflow.network_zone",
        ),
        # the policy `labels` keeps to the labels
        ([node("10.0.0.1", prefix=24), node("10.0.0.2", prefix=24)], "labels", NetworkDomain.UNKNOWN, "labels"),
        # one address on two hosts: two networks, even in one subnet
        (
            [
                node("10.0.0.1", prefix=24, mac="aa:00:00:00:00:01"),
                node("10.0.0.1", prefix=24, mac="aa:00:00:00:00:02"),
            ],
            "prove",
            NetworkDomain.PROVEN_DIFFERENT,
            "two hosts",
        ),
        # two agents on one machine (the same MAC and hostname) share its address: one network
        (
            [
                node("10.0.0.1", prefix=24, mac="AA:00:00:00:00:01", hostname="box"),
                node("10.0.0.1", prefix=24, mac="aa:00:00:00:00:01", hostname="box"),
            ],
            "prove",
            NetworkDomain.PROVEN_SAME,
            "10.0.0.0/24",
        ),
        # ... but not when a third node elsewhere holds the same address
        (
            [
                node("10.0.0.1", prefix=24, mac="aa:00:00:00:00:01", hostname="box"),
                node("10.0.0.1", prefix=24, mac="aa:00:00:00:00:01", hostname="box"),
                node("10.0.0.1", prefix=24, mac="aa:00:00:00:00:09", hostname="other"),
            ],
            "prove",
            NetworkDomain.PROVEN_DIFFERENT,
            "two hosts",
        ),
        # a bad prefix stored by hand proves nothing
        ([node("10.0.0.1", prefix=99), node("10.0.0.2", prefix=99)], "prove", NetworkDomain.UNKNOWN, "subnets"),
    ],
)
def test_a_shared_subnet_proves_one_network_when_nothing_says_otherwise(nodes, policy, expected, reason):
    verdict = same_network_domain(nodes, policy)
    assert verdict.domain == expected
    assert reason in verdict.reason


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError):
        same_network_domain([node(), node()], "guess")
