"""Rank wiring for task groups: each member's variables, the network decision, and the
hand-out where a task's own env cannot override them."""

import pytest

from apps.nodes.network import ZONE_LABEL, DomainVerdict, NetworkDomain
from apps.scheduler.services import run_cycle
from apps.tasks.api.views import agent_task
from apps.tasks.models import Task, TaskGroup
from apps.tasks.ranks import network_decision, rank_env
from tests.factories import make_group, make_node


def test_rank_variables_follow_the_nodes_in_rank_order():
    network = {"master_addr": "10.0.0.1", "master_port": 8000, "backend": "nccl"}
    nodes = ["a", "a", "b", "b", "c"]
    env = [rank_env(network, rank, nodes) for rank in range(5)]
    assert [e["RANK"] for e in env] == ["0", "1", "2", "3", "4"]
    assert [e["LOCAL_RANK"] for e in env] == ["0", "1", "0", "1", "0"]
    assert [e["NODE_RANK"] for e in env] == ["0", "0", "1", "1", "2"]
    assert [e["LOCAL_WORLD_SIZE"] for e in env] == ["2", "2", "2", "2", "1"]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"], e["HETEROFLOW_DIST_BACKEND"]) for e in env} == {
        ("5", "10.0.0.1", "8000", "nccl")
    }


@pytest.mark.parametrize(
    "gpu_type, domain, internal, expected",
    [
        ("nvidia", NetworkDomain.PROVEN_SAME, "10.0.0.1", ("nccl", "internal", "10.0.0.1")),
        ("Ascend", NetworkDomain.PROVEN_SAME, "10.0.0.1", ("hccl", "internal", "10.0.0.1")),
        ("virtual", NetworkDomain.PROVEN_SAME, "10.0.0.1", ("gloo", "internal", "10.0.0.1")),
        ("nvidia", NetworkDomain.UNKNOWN, "10.0.0.1", ("gloo", "public", "203.0.113.1")),
        ("nvidia", NetworkDomain.PROVEN_DIFFERENT, "10.0.0.1", ("gloo", "public", "203.0.113.1")),
        ("nvidia", NetworkDomain.PROVEN_SAME, None, ("gloo", "public", "203.0.113.1")),
    ],
)
def test_the_backend_needs_proof_of_one_network(gpu_type, domain, internal, expected):
    decision = network_decision(gpu_type, DomainVerdict(domain, "the why"), "a", internal, "203.0.113.1", 8000)
    assert (decision["backend"], decision["address"], decision["master_addr"]) == expected
    assert decision["domain"] == str(domain)
    assert internal is None or "(the why)" in decision["reason"]


@pytest.mark.django_db
def test_bind_decides_the_network_and_the_hand_out_carries_the_ranks(world):
    acme = world.tenants["acme"]
    for n, ip in enumerate(("10.0.0.1", "10.0.0.2")):
        make_node(f"n{n}", gpus=2, internal_ip=ip, ip=f"203.0.113.{n + 1}", labels={ZONE_LABEL: "vpc-a"})
    group = make_group(acme, workers=4, gpus=1, strategy="pp")
    Task.objects.filter(group=group).update(env={"RANK": "7", "MASTER_PORT": "1", "MINE": "kept"})
    assert run_cycle().groups_bound == [group.pk]
    group = TaskGroup.objects.get(pk=group.pk)
    members = list(Task.objects.filter(group=group).order_by("rank"))
    master = members[0]
    assert group.network["backend"] == "nccl" and group.network["address"] == "internal"
    assert group.network["master_node"] == master.node_id
    assert group.network["master_addr"] == {"n0": "10.0.0.1", "n1": "10.0.0.2"}[master.node_id]
    assert master.host_port == group.network["master_port"] and 8000 <= master.host_port < 9000
    assert all(member.host_port is None for member in members[1:])
    envs = [agent_task(member)["env"] for member in members]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]  # the task's own RANK lost
    assert {e["MASTER_PORT"] for e in envs} == {str(master.host_port)}
    assert {e["MINE"] for e in envs} == {"kept"}
    assert sorted(e["NODE_RANK"] for e in envs) == ["0", "0", "1", "1"]


@pytest.mark.django_db
def test_nodes_not_proven_on_one_network_get_public_addresses_and_gloo(world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=1, internal_ip="10.0.0.1", ip="203.0.113.1")
    make_node("n1", gpus=1, internal_ip="10.0.0.1", ip="203.0.113.2")  # the same private address: two VPCs
    group = make_group(acme, workers=2, gpus=1)
    run_cycle()
    network = TaskGroup.objects.get(pk=group.pk).network
    assert (network["domain"], network["backend"], network["address"]) == ("proven_different", "gloo", "public")
    assert network["master_addr"].startswith("203.0.113.")


@pytest.mark.django_db
def test_an_unlabelled_lan_is_one_network_by_its_subnet_and_the_decision_says_so(world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=1, internal_ip="192.168.5.10", internal_prefix=24, ip="203.0.113.1")
    make_node("n1", gpus=1, internal_ip="192.168.5.11", internal_prefix=24, ip="203.0.113.2")
    group = make_group(acme, workers=2, gpus=1)
    run_cycle()
    network = TaskGroup.objects.get(pk=group.pk).network
    assert (network["domain"], network["backend"], network["address"]) == ("proven_same", "nccl", "internal")
    assert "192.168.5.0/24" in network["reason"]
