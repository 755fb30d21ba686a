"""A card that drops out, on the six vendors whose tools renumber the cards after it
(Hygon, Iluvatar, Biren, Moore Threads, MetaX, Enflame): recorded outputs of each tool
before and after card 1 of 4 drops out (tests/fixtures/DROPS.md says where each format
comes from). The tool's indices move; what each card reports as its identity (UUID or
PCI address) does not, and is sent with it, so the server can name the card that went.
Where the tool prints neither, the beat says its indices are positions."""

from __future__ import annotations

from pathlib import Path

import pytest

from heteroflow_agent.client import ServerClient
from heteroflow_agent.collect import EngineState
from heteroflow_agent.config import AgentConfig
from heteroflow_agent.detect.model import Detection
from heteroflow_agent.detect.parsing import pci_bus_id
from heteroflow_agent.heartbeat import Heartbeat, TaskReport
from heteroflow_agent.version import Version

from .conftest import rule

# vendor: (tool, where it is installed, fixture of the 4 cards before, of the 3 after,
# the arguments the per-beat run must carry, the identity the tool prints)
DROPS = {
    "hygon": (
        "hy-smi",
        "opt/hyhal/bin",
        "hygon/hy-smi_4x_before_drop.json",
        "hygon/hy-smi_3x_after_drop.json",
        ["--showbus", "--json"],
        "pci_bus_id",
    ),
    "iluvatar": (
        "ixsmi",
        "usr/local/corex/bin",
        "iluvatar/ixsmi_4x_before_drop.csv",
        "iluvatar/ixsmi_3x_after_drop.csv",
        ["--query-gpu="],
        "uuid",
    ),
    "biren": (
        "brsmi",
        "usr/local/bin",
        "biren/brsmi_4x_before_drop.txt",
        "biren/brsmi_3x_after_drop.txt",
        [],
        "pci_bus_id",
    ),
    "musa": (
        "mthreads-gmi",
        "usr/bin",
        "musa/mthreads-gmi_4x_before_drop.txt",
        "musa/mthreads-gmi_3x_after_drop.txt",
        [],
        "pci_bus_id",
    ),
    "metax": (
        "mx-smi",
        "opt/mxdriver/bin",
        "metax/mx-smi_4x_before_drop.txt",
        "metax/mx-smi_3x_after_drop.txt",
        [],
        "pci_bus_id",
    ),
    "enflame": (
        "efsmi",
        "opt/efsmi/bin",
        "enflame/efsmi_q_4x_before_drop.txt",
        "enflame/efsmi_q_3x_after_drop.txt",
        ["-q"],
        "uuid",
    ),
}


def _tool(host, vendor, fixture):
    tool, at, _before, _after, when, _identity = DROPS[vendor]
    host.tool(tool, rule(fixture, when=when), at=at)


@pytest.mark.parametrize("vendor", sorted(DROPS))
def test_after_a_drop_the_cards_are_renumbered_but_each_keeps_its_identity(host, validate, vendor):
    _tool_name, _at, before, after, _when, identity = DROPS[vendor]
    detector = host.detector()
    _tool(host, vendor, before)
    first = detector.detect()
    assert (first.vendor, first.collector_error) == (vendor, "")
    assert [g["index"] for g in first.gpus] == [0, 1, 2, 3]
    named = [g[identity] for g in first.gpus]
    assert len(set(named)) == 4 and all(named), named
    validate(first.heartbeat_fields())

    _tool(host, vendor, after)  # card 1 is gone: the tool lists the others as 0, 1, 2
    second = detector.detect()
    assert (second.vendor, second.collector_error) == (vendor, "")
    assert [g["index"] for g in second.gpus] == [0, 1, 2]
    assert [g[identity] for g in second.gpus] == [named[0], named[2], named[3]]
    assert set(named) - {g[identity] for g in second.gpus} == {named[1]}, "the card that went is card 1"
    assert second.collect_failures == [], "a positional tool reports nothing per card"
    fields = second.heartbeat_fields()
    assert fields["gpu_index_basis"] == "position"
    validate(fields)


def test_the_bus_ids_are_written_one_way_whatever_the_tools_width(host):
    by_vendor = {}
    for vendor in ("hygon", "biren", "musa", "metax", "enflame"):
        _tool(host, vendor, DROPS[vendor][2])
        by_vendor[vendor] = [g["pci_bus_id"] for g in host.detector().detect().gpus]
        (host.root / DROPS[vendor][1] / DROPS[vendor][0]).unlink()
    assert by_vendor == {
        "hygon": ["0000:05:00.0", "0000:14:00.0", "0000:1a:00.0", "0000:2b:00.0"],  # "... --> SN: ... --> OAM ID"
        "biren": ["0000:1b:00.0", "0000:1c:00.0", "0000:3d:00.0", "0000:3e:00.0"],  # 00000000:1B:00.0
        "musa": ["0000:3f:00.0", "0000:40:00.0", "0000:5b:00.0", "0000:5c:00.0"],
        "metax": ["0000:0f:00.0", "0000:34:00.0", "0000:48:00.0", "0000:5a:00.0"],
        "enflame": ["0000:17:00.0", "0000:18:00.0", "0000:31:00.0", "0000:32:00.0"],  # Domain, Bus, Dev, Func
    }


def test_the_per_beat_run_of_hy_smi_asks_for_the_bus(host):
    _tool(host, "hygon", DROPS["hygon"][2])
    host.detector().detect()
    (argv,) = [call for call in host.calls("hy-smi") if "--json" in call]
    assert "--showbus" in argv


def test_efsmi_in_the_older_layout_still_reads_the_bus_and_uuid(host):
    host.tool("efsmi", rule("enflame/efsmi_q_8x_s60.txt", when=["-q"]), at="opt/efsmi/bin")
    cards = host.detector().detect().gpus
    assert (cards[0]["uuid"], cards[0]["pci_bus_id"]) == ("405301d6-fae5-e38c-f1b6-1c4686ad8494", "0000:2e:00.0")


def test_efsmi_in_the_current_layout_reads_every_metric(host):
    host.tool("efsmi", rule("enflame/efsmi_q_4x_before_drop.txt", when=["-q"]), at="opt/efsmi/bin")
    card = host.detector().detect().gpus[1]
    assert {k: card.get(k) for k in ("model", "memory_total_mb", "memory_used_mb", "utilization", "temperature")} == {
        "model": "S60",
        "memory_total_mb": 42976,
        "memory_used_mb": 46002,
        "utilization": 97.5,
        "temperature": 41,
    }
    assert card["power_w"] == 251


def test_a_tool_that_prints_no_identity_sends_none_and_says_its_indices_are_positions(host, validate):
    detector = host.detector()
    host.tool("efsmi", rule("enflame/efsmi_q_4x_no_ids_before_drop.txt", when=["-q"]), at="opt/efsmi/bin")
    assert len(detector.detect().gpus) == 4
    host.tool("efsmi", rule("enflame/efsmi_q_3x_no_ids_after_drop.txt", when=["-q"]), at="opt/efsmi/bin")
    after = detector.detect()
    assert [g["index"] for g in after.gpus] == [0, 1, 2]
    assert not any("uuid" in g or "pci_bus_id" in g for g in after.gpus)
    assert after.gpus[2]["memory_used_mb"] == 39980  # the old card 3's reading, now under index 2
    fields = after.heartbeat_fields()
    assert fields["gpu_index_basis"] == "position"
    validate(fields)


def test_an_identity_two_cards_show_is_sent_for_neither(host, validate):
    table = (Path(__file__).resolve().parent.parent / "fixtures" / "metax/mx-smi_4x_before_drop.txt").read_text()
    host.tool("mx-smi", rule(text=table.replace("0000:48:00.0", "0000:0f:00.0")), at="opt/mxdriver/bin")
    result = host.detector().detect()
    assert [g.get("pci_bus_id") for g in result.gpus] == [None, "0000:34:00.0", None, "0000:5a:00.0"]
    validate(result.heartbeat_fields())


@pytest.mark.parametrize("attribution,basis", [("full", "stable"), ("partial", "stable"), ("none", "position")])
def test_the_index_basis_follows_the_capability_matrix(attribution, basis):
    assert Detection(vendor="x", failure_attribution=attribution).index_basis == basis


@pytest.mark.parametrize(
    "printed,written",
    [
        ("00000000:3F:00.0", "0000:3f:00.0"),  # nvidia-smi's clones: eight-digit domain
        ("0000:0f:00.0", "0000:0f:00.0"),
        ("00:2e:00.0", "0000:2e:00.0"),  # efsmi's two-digit domain
        ("3f:00.0", "0000:3f:00.0"),  # no domain
        ("0000:05:00.0 --> SN: 2500238601000586 --> OAM ID: 1", "0000:05:00.0"),
        ("0001:81:00.1", "0001:81:00.1"),
        ("N/A", ""),
        ("", ""),
        (None, ""),
        ("10:12:03 CST", ""),  # a time is not an address
        ("100000000:3f:00.0", ""),  # a domain wider than four digits
    ],
)
def test_pci_bus_id(printed, written):
    assert pci_bus_id(printed) == written


class _NoEngine:
    def state(self):
        return EngineState(False, "no container engine here")

    def image_tags(self):
        return []


def test_the_heartbeat_carries_the_identities_and_the_index_basis(host, tmp_path, validate):
    _tool(host, "metax", DROPS["metax"][3])
    config = AgentConfig(
        server_url="http://unused", api_key="k", node_id="mx-1", data_dir=tmp_path, model_scan_dirs=(str(tmp_path),)
    )
    beat = Heartbeat(
        config,
        ServerClient("http://unused", "k"),
        detect_gpus=host.detector().detect,
        engine=_NoEngine(),
        tasks=TaskReport,
        version=Version("1.2.3", "abc1234", "2026-11-29T10:00:00Z"),
    )
    body = beat.payload()
    assert body["gpu_index_basis"] == "position"
    assert [g["pci_bus_id"] for g in body["gpu_stats"]] == ["0000:0f:00.0", "0000:48:00.0", "0000:5a:00.0"]
    validate({key: body[key] for key in ("gpu_stats", "gpu_index_basis")})
