"""The vendors' parsers on outputs recorded from the vendors' documentation, and the
rules of each vendor that the channel tests do not reach."""

from __future__ import annotations

from pathlib import Path

import pytest

from heteroflow_agent.detect.command import ToolResult
from heteroflow_agent.detect.hygon import parse_devices
from heteroflow_agent.detect.mig import (
    ListingError,
    list_instances,
    parse_compute_instances,
    parse_gpu_instances,
    parse_listing,
    parse_mig_devices,
    parse_profiles,
)
from heteroflow_agent.slicing import hami, mig, mps
from heteroflow_agent.slicing.base import Budget

RECORDED = Path(__file__).resolve().parent.parent / "fixtures" / "slicing"


def recorded(name: str) -> str:
    return (RECORDED / name).read_text()


def test_gpu_instance_profiles():
    profiles = parse_profiles(recorded("lgip_a100_40gb.txt"))
    assert [p["name"] for p in profiles] == [
        "1g.5gb",
        "1g.5gb+me",
        "1g.10gb",
        "2g.10gb",
        "3g.20gb",
        "4g.20gb",
        "7g.40gb",
    ]
    assert profiles[4] == {"gpu": 0, "name": "3g.20gb", "id": 9, "free": 2, "total": 2, "memory_gib": 19.5}


def test_gpu_and_compute_instances():
    assert [
        (g["gi"], g["profile"], g["profile_id"], g["start"]) for g in parse_gpu_instances(recorded("lgi_a100_40gb.txt"))
    ] == [
        (7, "1g.5gb", 19, 0),
        (8, "1g.5gb", 19, 1),
        (3, "2g.10gb", 14, 2),
        (2, "3g.20gb", 9, 4),
    ]
    assert parse_compute_instances(recorded("lci_a100_40gb.txt")) == [
        {"gpu": 0, "gi": 7, "profile": "1g.5gb", "ci": 0},
        {"gpu": 0, "gi": 8, "profile": "1g.5gb", "ci": 0},
        {"gpu": 0, "gi": 2, "profile": "3g.20gb", "ci": 0},
    ]


def test_the_listing_and_the_mig_devices_table():
    listing = parse_listing(recorded("L_a100_40gb.txt"))
    assert listing[0]["uuid"] == "GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77"
    assert listing[0]["devices"][2] == "MIG-1d4d0f3f-a93b-5b2d-b9e8-8bc2ea1dcb4d"
    assert listing[1] == {"uuid": "GPU-4bd5b2e6-5e9c-3d3f-8d1c-7b6a9c1e2f30", "devices": {}}
    assert parse_mig_devices(recorded("smi_mig_devices_a100_40gb.txt")) == {
        (0, 2): (2, 0),
        (0, 0): (7, 0),
        (0, 1): (8, 0),
    }


def fake_run(answers: dict):
    def run(argv):
        key = " ".join(argv[1:])
        out, code = answers[key]
        return ToolResult(tuple(argv), code, out if code == 0 else "", "" if code == 0 else out)

    return run


def test_the_join_gives_each_instance_its_uuid_and_a_gpu_instance_without_ci_has_none():
    run = fake_run(
        {
            "mig -lgi": (recorded("lgi_a100_40gb.txt"), 0),
            "mig -lci": (recorded("lci_a100_40gb.txt"), 0),
            "": (recorded("smi_mig_devices_a100_40gb.txt"), 0),
            "-L": (recorded("L_a100_40gb.txt"), 0),
        }
    )
    assert list_instances(run, "nvidia-smi") == {
        0: [
            {"uuid": "MIG-1d4d0f3f-a93b-5b2d-b9e8-8bc2ea1dcb4d", "gi": 2, "ci": 0, "profile": "3g.20gb"},
            {"uuid": "", "gi": 3, "profile": "2g.10gb"},  # 2g.10gb has no compute instance
            {"uuid": "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f", "gi": 7, "ci": 0, "profile": "1g.5gb"},
            {"uuid": "MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb", "gi": 8, "ci": 0, "profile": "1g.5gb"},
        ]
    }


def test_no_instances_is_an_empty_listing_and_a_failed_listing_is_an_error():
    empty = fake_run(
        {
            "mig -lgi": ("No GPU instances found: Not Found", 6),
            "mig -lci": ("No compute instances found: Not Found", 6),
            "": ("", 0),
            "-L": (recorded("L_a100_40gb.txt"), 0),
        }
    )
    assert list_instances(empty, "nvidia-smi") == {}
    broken = fake_run({"mig -lgi": ("Failed to initialize NVML: Driver/library version mismatch", 9)})
    with pytest.raises(ListingError, match="version mismatch"):
        list_instances(broken, "nvidia-smi")


def test_the_create_output_lines():
    text = recorded("cgi_3g20gb.txt")
    assert mig._CREATED_GI.search(text)[1] == "2"
    assert mig._CREATED_CI.search(text)[1] == "0"


def test_the_vdcu_listings():
    assert parse_devices(recorded("hy_smi_virtual_device_info.txt")) == [
        {"id": 0, "device": 0, "compute_units": 60, "memory_mib": 32752},
        {"id": 1, "device": 1, "compute_units": 60, "memory_mib": 32752},
    ]
    vdevs = parse_devices(recorded("hy_smi_virtual_vdevice_info.txt"))
    assert [(v["id"], v["device"], v["compute_units"], v["memory_mib"]) for v in vdevs] == [
        (0, 7, 5, 4096),
        (1, 7, 15, 8192),
        (2, 7, 20, 8192),
        (3, 7, 20, 8192),
    ]


def test_hami_destroys_one_vdcu_only_with_the_last_of_its_card(cards):
    """The tool destroys every vDCU of a card: a destroy waits for its neighbours'."""
    cards.hygon(count=2)
    vendor = hami.HygonHami(str(cards.root))
    a = vendor.create({"gpu_index": 0, "memory_mb": 4096, "compute_percent": 25}, Budget())
    b = vendor.create({"gpu_index": 0, "memory_mb": 8192, "compute_percent": 50}, Budget())
    c = vendor.create({"gpu_index": 1, "memory_mb": 2048, "compute_percent": 10}, Budget())
    assert (a.ok, b.ok, c.ok) == (True, True, True)
    assert [v["id"] for v in cards.read()["vdevs"]] == [0, 1, 2]
    first = vendor.destroy({"gpu_index": 0, "device_id": a.device_id, "handles": a.handles}, Budget())
    assert not first.ok and "also holds vDCU 1" in first.error
    assert len(cards.read()["vdevs"]) == 3  # nothing destroyed
    second = vendor.destroy({"gpu_index": 0, "device_id": b.device_id, "handles": b.handles}, Budget())
    assert second.ok and second.destroyed == [{"uuid": "vdev0"}, {"uuid": "vdev1"}]
    assert [v["id"] for v in cards.read()["vdevs"]] == [2]  # the other card's vDCU stays
    again = vendor.destroy({"gpu_index": 0, "device_id": a.device_id, "handles": a.handles}, Budget())
    assert again.ok and again.destroyed == []  # gone with its neighbour


def test_hami_refuses_what_the_card_cannot_hold(cards):
    cards.hygon()
    vendor = hami.HygonHami(str(cards.root))
    too_big = vendor.create({"gpu_index": 0, "memory_mb": 40000, "compute_percent": 50}, Budget())
    assert not too_big.ok and too_big.error.startswith("refused: 40000 MiB is more than DCU 0 has")
    no_card = vendor.create({"gpu_index": 5, "memory_mb": 1024, "compute_percent": 5}, Budget())
    assert not no_card.ok and "this node has no DCU 5" in no_card.error
    for _ in range(4):
        assert vendor.create({"gpu_index": 0, "memory_mb": 1024, "compute_percent": 5}, Budget()).ok
    fifth = vendor.create({"gpu_index": 0, "memory_mb": 1024, "compute_percent": 5}, Budget())
    assert not fifth.ok and "at most 4 virtual devices" in fifth.error and "exit code 1" in fifth.error
    assert fifth.created == []


def test_hami_needs_its_tool(cards):
    vendor = hami.HygonHami(str(cards.root))
    outcome = vendor.create({"gpu_index": 0, "memory_mb": 1024, "compute_percent": 5}, Budget())
    assert not outcome.ok and "neither hy-smi nor hy-virtual" in outcome.error


def test_mps_refuses_bad_limits_and_a_missing_card(cards):
    cards.nvidia(mig=False)
    cards.mps(alive=True)
    vendor = mps.NvidiaMps(str(cards.root), pipe_directory="/run/mps")
    assert "not a share" in vendor.create({"gpu_index": 0, "memory_mb": 10, "compute_percent": 0}, Budget()).error
    assert "not a limit" in vendor.create({"gpu_index": 0, "memory_mb": None, "compute_percent": 5}, Budget()).error
    assert "no GPU 2" in vendor.create({"gpu_index": 2, "memory_mb": 10, "compute_percent": 5}, Budget()).error
    done = vendor.create({"gpu_index": 0, "memory_mb": 10, "compute_percent": 5}, Budget())
    assert done.ok and done.handles["pipe_directory"] == "/run/mps"


def test_mps_without_the_control_tool(cards):
    cards.nvidia(mig=False)
    outcome = mps.NvidiaMps(str(cards.root)).create({"gpu_index": 0, "memory_mb": 10, "compute_percent": 5}, Budget())
    assert not outcome.ok and "nvidia-cuda-mps-control is not on this node" in outcome.error


def test_a_budget_that_is_spent_runs_nothing():
    budget = Budget(seconds=0.0)
    with pytest.raises(Exception, match="ran out"):
        budget.run(["true"])
