"""The right card is named lost (apps.nodes.card_identity, apps.nodes.heartbeat).

Vendors whose tools renumber the cards after one drops out: card 1 of 4 fails and the
tool lists the old cards 0, 2, 3 as 0, 1, 2. Matched by UUID or PCI address, card 1 is
named lost and the others keep their rows and readings; with neither, the row at the
position that went missing is lost and everything says that which card it was cannot be
told. An older agent (no identities, no gpu_index_basis) is judged by index as before.
Beats go through the real heartbeat route; the last test sends what the real agent reads
from each vendor's recorded outputs (agent/tests/fixtures/DROPS.md)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from apps.alerts.models import Alert
from apps.nodes import card_identity
from apps.nodes.card_identity import Reported, Row
from apps.nodes.models import Gpu, Node, NodeMetric
from apps.nodes.presenters import present_one
from tests.nodes.payloads import gpu_stat
from tests.nodes.payloads import heartbeat as payload

pytestmark = pytest.mark.django_db(transaction=True)  # the heartbeat route writes on its own connection

UUIDS = ["GPU-aa", "GPU-bb", "GPU-cc", "GPU-dd"]
BUSES = ["0000:05:00.0", "0000:14:00.0", "0000:1a:00.0", "0000:2b:00.0"]


def cards(physical, *, identity, vendor="metax"):
    """The beat's gpu_stats when the physical cards `physical` (their numbers when the
    node was first seen) are the ones present: listed by position, as the tool does."""
    stats = []
    for position, card in enumerate(physical):
        stat = gpu_stat(position, vendor=vendor, model="MetaX C550", memory_total_mb=65536)
        stat.pop("compute_capability")
        stat["uuid"] = UUIDS[card] if identity == "uuid" else ""
        if not stat["uuid"]:
            del stat["uuid"]
        if identity == "pci_bus_id":
            stat["pci_bus_id"] = BUSES[card]
        stat["memory_used_mb"] = 1000 * (card + 1)  # each physical card's own reading
        stats.append(stat)
    return stats


def beat(physical, *, identity, basis="position", **fields):
    stats = cards(physical, identity=identity)
    extra = {"gpu_index_basis": basis} if basis else {}
    return payload(
        gpus=0,
        gpu_stats=stats,
        gpu_capabilities={str(s["index"]): {"mps_capable": False, "best_tier": 9} for s in stats},
        **extra,
        **fields,
    )


def rows_of(node_id):
    return {g.index: g for g in Gpu.objects.filter(node_id=node_id)}


def drop_card_1(agents, node_id, *, identity, basis="position"):
    """Four cards, then card 1 gone for three beats (the tool renumbers the others)."""
    assert agents.send(node_id, beat([0, 1, 2, 3], identity=identity, basis=basis)).status_code == 200
    for _beat in range(3):
        assert agents.send(node_id, beat([0, 2, 3], identity=identity, basis=basis)).status_code == 200


@pytest.fixture
def asked(monkeypatch):
    """The jobs the heartbeat route asks for (the per-task trace of lost cards)."""
    from apps.nodes.api import heartbeat as route

    calls = []
    monkeypatch.setattr(route, "enqueue", lambda name, *args: calls.append((name, args)))
    return calls


@pytest.mark.parametrize("identity", ["uuid", "pci_bus_id"])
def test_a_renumbered_drop_of_card_1_names_card_1(agents, asked, identity):
    node_id = f"renumbered-{identity}"
    drop_card_1(agents, node_id, identity=identity)
    rows = rows_of(node_id)
    assert sorted(rows) == [0, 1, 2, 3]
    assert [i for i, g in rows.items() if g.lost_at is not None] == [1]
    assert rows[1].lost_basis == "heartbeat_absent" and rows[1].reported_index is None
    # the others keep their rows, and each row reads its own card under the tool's new index
    assert {i: (g.reported_index, g.memory_used_mb) for i, g in rows.items() if i != 1} == {
        0: (0, 1000),
        2: (1, 3000),
        3: (2, 4000),
    }
    assert {g.matched_by for g in rows.values()} == {identity}
    named = UUIDS[1] if identity == "uuid" else BUSES[1]
    assert getattr(rows[1], identity) == named
    alert = Alert.objects.get(type="GPU_LOST")
    assert (alert.node_id, alert.gpu_index, alert.state) == (node_id, 1, "ACTIVE")
    assert named in alert.message and alert.message.startswith(f"GPU 1 of node {node_id} (")
    assert alert.details == {"basis": "heartbeat_absent", "matched_by": identity, "identified": True, identity: named}
    assert [args for name, args in asked if name == "nodes.record_card_losses"] == [
        (node_id, [[1, "heartbeat_absent"]])
    ]
    # the metrics history keeps each card under its row
    sample = NodeMetric.objects.filter(node_id=node_id).order_by("-at", "-id").first()
    assert [(g["i"], g["m"]) for g in sample.gpus] == [(0, 1000), (2, 3000), (3, 4000)]
    # the capabilities too: what the tool said of its index 1 is card 2's
    assert set(Node.objects.get(pk=node_id).gpu_capabilities) == {"0", "2", "3"}
    node = present_one(Node.objects.get(pk=node_id))
    assert (node["gpus_lost"], node["gpus_lost_unidentified"], node["gpu_loss_note"]) == (1, 0, "")
    # the moved cards take no new work: the agent would start it on the card at that index
    assert [g["state"] for g in node["gpus"]] == ["available", "lost", "cordoned", "cordoned"]
    assert (rows[2].cordon_source, rows[2].cordon_evidence["reported_index"]) == ("renumbered", 1)
    assert "under index 1 now" in rows[2].cordon_reason


def test_the_card_that_comes_back_recovers_and_the_others_go_back_to_their_indices(agents):
    drop_card_1(agents, "returns", identity="pci_bus_id")
    # operators' cordons (one over a renumbered card's) are never lifted when the indices agree again
    Gpu.objects.filter(node_id="returns", index__in=[0, 3]).update(cordon_source="operator", cordon_reason="fan")
    Gpu.objects.filter(node_id="returns", index=0).update(
        cordoned_at=Gpu.objects.get(node_id="returns", index=3).cordoned_at
    )
    for _beat in range(2):
        agents.send("returns", beat([0, 1, 2, 3], identity="pci_bus_id"))
    rows = rows_of("returns")
    assert all(g.lost_at is None and g.reported_index == i for i, g in rows.items())
    assert rows[1].memory_used_mb == 2000
    assert Alert.objects.get(type="GPU_LOST").state == "RECOVERED"
    assert {i: g.cordon_source for i, g in rows.items()} == {0: "operator", 1: "", 2: "", 3: "operator"}


def test_without_an_identity_the_lost_card_cannot_be_told(agents, asked):
    drop_card_1(agents, "no-ids", identity=None)
    rows = rows_of("no-ids")
    assert [i for i, g in rows.items() if g.lost_at is not None] == [3], "the position that went missing"
    assert rows[3].matched_by == "position"
    alert = Alert.objects.get(type="GPU_LOST")
    assert alert.gpu_index is None, "no index is named"
    assert alert.message.startswith("A GPU of node no-ids is lost (heartbeat_absent), and which one cannot be told")
    assert "position 3" in alert.message
    assert alert.details == {"basis": "heartbeat_absent", "matched_by": "position", "identified": False, "position": 3}
    assert not [args for name, args in asked if name == "nodes.record_card_losses"], "nor its tasks"
    node = present_one(Node.objects.get(pk="no-ids"))
    assert (node["gpus_lost"], node["gpus_lost_unidentified"]) == (1, 1)
    assert node["gpu_loss_note"].startswith("A GPU of this node is lost, and which one cannot be told")
    assert [g["matched_by"] for g in node["gpus"]] == ["position"] * 4


def test_an_older_agent_without_identities_is_judged_by_index_as_before(agents, asked):
    drop_card_1(agents, "old-agent", identity=None, basis=None)
    rows = rows_of("old-agent")
    assert [i for i, g in rows.items() if g.lost_at is not None] == [3]
    assert {g.matched_by for g in rows.values()} == {"index"}
    alert = Alert.objects.get(type="GPU_LOST")
    assert (alert.gpu_index, alert.message) == (3, "GPU 3 of node old-agent is lost (heartbeat_absent).")
    assert alert.details == {"basis": "heartbeat_absent", "matched_by": "index", "identified": True}
    assert [args for name, args in asked if name == "nodes.record_card_losses"] == [
        ("old-agent", [[3, "heartbeat_absent"]])
    ]
    node = present_one(Node.objects.get(pk="old-agent"))
    assert (node["gpus_lost_unidentified"], node["gpu_loss_note"]) == (0, "")


def test_an_older_agents_beat_keeps_its_structure_hash():
    from apps.nodes.heartbeat import structure_hash

    old = payload(gpus=2)
    newer = copy.deepcopy(old) | {"gpu_index_basis": "stable"}
    assert structure_hash(newer) != structure_hash(old)
    assert structure_hash(copy.deepcopy(old)) == structure_hash(old)


def test_a_card_replaced_in_its_slot_takes_the_slots_row(agents):
    agents.send("swap", beat([0, 1, 2, 3], identity="uuid"))
    replaced = beat([0, 1, 2, 3], identity="uuid")
    replaced["gpu_stats"][1]["uuid"] = "GPU-new"
    agents.send("swap", replaced)
    rows = rows_of("swap")
    assert sorted(rows) == [0, 1, 2, 3] and rows[1].uuid == "GPU-new" and rows[1].reported_index == 1
    assert all(g.absent_streak == 0 for g in rows.values())


def test_a_stable_agent_restarted_after_a_drop_keeps_every_card_on_its_row(agents):
    """NVIDIA after an agent restart: the agent numbers the cards afresh (the tool's own
    indices) and says they are stable; the UUIDs still place them, and their health
    readings land on their cards."""
    agents.send("restart", beat([0, 1, 2, 3], identity="uuid", basis="stable"))
    health = [{"index": 1, "available": ["ecc_uncorrected_volatile"], "ecc_uncorrected_volatile": 7}]
    agents.send("restart", beat([0, 2, 3], identity="uuid", basis="stable", gpu_health=health))
    rows = rows_of("restart")
    assert rows[1].reported_index is None and rows[1].absent_streak == 1
    assert rows[2].health.get("ecc_uncorrected_volatile") == 7, "the tool's index 1 is card 2"
    assert rows[1].health == {}


def test_a_collect_failure_lands_on_its_cards_row(agents):
    agents.send("failing", beat([0, 1, 2, 3], identity="uuid", basis="stable"))
    failing = beat([0, 2, 3], identity="uuid", basis="stable")
    failing["gpu_stats"] = [s | {"index": i} for i, s in zip((0, 2, 3), failing["gpu_stats"], strict=True)]
    failing["gpu_collect_failures"] = [{"index": 1, "uuid": UUIDS[1], "error": "NVML_ERROR_GPU_IS_LOST"}]
    for _beat in range(3):
        agents.send("failing", failing)
    assert rows_of("failing")[1].lost_basis == "agent_collect_failure"


# --- the rule itself, without a database ------------------------------------------------


def test_place_matches_by_uuid_then_bus_then_index():
    rows = [Row(0, "U0"), Row(1, "", "0000:14:00.0"), Row(2), Row(3, "U3")]
    reported = [Reported(0, "U3"), Reported(1, "U0"), Reported(2), Reported(3, "", "0000:14:00.0")]
    placement = card_identity.place(rows, reported)
    assert placement.rows == {0: 3, 1: 0, 2: 2, 3: 1}
    assert placement.unreported == () and placement.created == frozenset()


def test_place_lets_a_new_card_take_its_slots_row_when_that_card_is_gone():
    rows = [Row(0, "U0"), Row(1, "U1")]
    placement = card_identity.place(rows, [Reported(0, "U0"), Reported(1, "U9")])
    assert placement.rows == {0: 0, 1: 1} and placement.unreported == ()


def test_place_gives_a_card_its_own_index_only_when_it_is_free():
    rows = [Row(0, "U0"), Row(1, "U1"), Row(2, "U2"), Row(3, "U3")]
    placement = card_identity.place(rows, [Reported(0, "U0"), Reported(1, "U2"), Reported(2, "U3"), Reported(3, "U9")])
    assert placement.rows == {0: 0, 1: 2, 2: 3, 3: 4}, "U9 is new: row 3 is U3's, and 1 is the lost card's"
    assert (placement.created, placement.unreported) == (frozenset({4}), (1,))


def test_place_does_not_match_two_uuids_that_differ_by_their_bus():
    rows = [Row(0, "U0", "0000:05:00.0"), Row(1, "U1", "0000:14:00.0")]
    placement = card_identity.place(rows, [Reported(0, "U0", "0000:05:00.0"), Reported(5, "U7", "0000:14:00.0")])
    assert placement.rows == {0: 0, 5: 5} and placement.unreported == (1,)


def test_place_ignores_an_identity_two_cards_share():
    rows = [Row(0, "", "0000:05:00.0"), Row(1, "", "0000:14:00.0")]
    placement = card_identity.place(rows, [Reported(0, "", "0000:14:00.0"), Reported(1, "", "0000:14:00.0")])
    assert placement.rows == {0: 0, 1: 1}, "by index, as a beat without identities"


def test_a_failure_finds_its_row_but_never_makes_one():
    rows = [Row(0, "U0"), Row(1, "U1")]
    placement = card_identity.place(rows, [Reported(0, "U0"), Reported(3, "U1", stat=False), Reported(4, stat=False)])
    assert placement.rows == {0: 0, 3: 1} and placement.created == frozenset()


# --- the real agent over each vendor's recorded outputs ---------------------------------

FIXTURES = Path(__file__).resolve().parents[2] / "agent" / "tests" / "fixtures"
VENDORS = {  # vendor: (where its tool is installed, the tool, fixture before, after, identity)
    "hygon": ("opt/hyhal/bin", "hy-smi", "hygon/hy-smi_4x_before_drop.json", "hygon/hy-smi_3x_after_drop.json"),
    "iluvatar": (
        "usr/local/corex/bin",
        "ixsmi",
        "iluvatar/ixsmi_4x_before_drop.csv",
        "iluvatar/ixsmi_3x_after_drop.csv",
    ),
    "biren": ("usr/local/bin", "brsmi", "biren/brsmi_4x_before_drop.txt", "biren/brsmi_3x_after_drop.txt"),
    "musa": ("usr/bin", "mthreads-gmi", "musa/mthreads-gmi_4x_before_drop.txt", "musa/mthreads-gmi_3x_after_drop.txt"),
    "metax": ("opt/mxdriver/bin", "mx-smi", "metax/mx-smi_4x_before_drop.txt", "metax/mx-smi_3x_after_drop.txt"),
    "enflame": ("opt/efsmi/bin", "efsmi", "enflame/efsmi_q_4x_before_drop.txt", "enflame/efsmi_q_3x_after_drop.txt"),
    "enflame-no-ids": (
        "opt/efsmi/bin",
        "efsmi",
        "enflame/efsmi_q_4x_no_ids_before_drop.txt",
        "enflame/efsmi_q_3x_no_ids_after_drop.txt",
    ),
}


class _NoEngine:
    def state(self):
        from heteroflow_agent.collect import EngineState

        return EngineState(False, "no container engine here")

    def image_tags(self):
        return []


@pytest.mark.parametrize("case", sorted(VENDORS))
def test_the_real_agent_over_recorded_outputs_names_the_card_that_went(agents, asked, tmp_path, case):
    from heteroflow_agent.client import ServerClient
    from heteroflow_agent.config import AgentConfig
    from heteroflow_agent.detect import Detector
    from heteroflow_agent.heartbeat import Heartbeat, TaskReport

    at, name, before, after = VENDORS[case]
    tools = tmp_path / "root" / at
    tools.mkdir(parents=True)
    tool = tools / name

    def prints(fixture):  # the stand-in prints the recorded output, whatever it is asked
        tool.write_text(f"#!/bin/sh\ncat '{FIXTURES / fixture}'\n")
        tool.chmod(0o755)

    config = AgentConfig(
        server_url="http://testserver",
        api_key="unused",
        node_id=case,
        data_dir=tmp_path,
        model_scan_dirs=(str(tmp_path),),
    )
    heartbeat = Heartbeat(
        config,
        ServerClient("http://testserver", "unused"),
        detect_gpus=Detector(str(tmp_path / "root"), 5.0, is_container=True, nvml=False).detect,
        engine=_NoEngine(),
        tasks=TaskReport,
    )
    prints(before)
    assert agents.send(case, heartbeat.payload()).status_code == 200
    first = rows_of(case)
    prints(after)
    for _beat in range(3):
        response = agents.send(case, heartbeat.payload())
        assert response.status_code == 200, response.text
    rows = rows_of(case)
    lost = [i for i, g in rows.items() if g.lost_at is not None]
    alert = Alert.objects.get(type="GPU_LOST", node_id=case)
    if case == "enflame-no-ids":
        assert lost == [3] and alert.gpu_index is None and "cannot be told" in alert.message
        return
    assert lost == [1], "card 1 went, not the last index"
    assert alert.gpu_index == 1
    identity = first[1].uuid or first[1].pci_bus_id
    assert identity and identity in alert.message
    assert [rows[i].reported_index for i in (0, 2, 3)] == [0, 1, 2]
    assert [(rows[i].uuid, rows[i].pci_bus_id) for i in (0, 2, 3)] == [
        (first[i].uuid, first[i].pci_bus_id) for i in (0, 2, 3)
    ]
