"""The slicing part of the heartbeat from stateful stand-ins: the MIG instances of a
card in MIG mode and whether a Hygon card can be carved into vDCUs, checked against the
heartbeat schema the server validates beats with."""

from __future__ import annotations

import pytest
from agent.tests.slicing_host import Cards

from heteroflow_agent.detect import Detector
from heteroflow_agent.slicing import mig
from heteroflow_agent.slicing.base import Budget


@pytest.fixture
def cards(tmp_path, monkeypatch) -> Cards:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    return Cards(tmp_path)


def detector(cards, container=False) -> Detector:
    return Detector(str(cards.root), timeout=5.0, nvml=False, is_container=container)


def test_a_mig_card_reports_its_instances(cards, validate):
    cards.nvidia(count=2)
    state = cards.read()
    state["gpus"][1]["mig"] = False
    cards.write(state)
    vendor = mig.NvidiaMig(str(cards.root))
    made = vendor.create({"gpu_index": 0, "profile": "2g.10gb"}, Budget())
    cards.fail(cci="Insufficient Resources")
    vendor.create({"gpu_index": 0, "profile": "1g.5gb"}, Budget())  # leaves a GPU instance without CI
    caps = detector(cards).detect().capabilities
    assert caps["0"]["mig_capable"] is True
    assert caps["0"]["mig_instances"] == [
        {"uuid": made.device_id, "gi": 1, "ci": 0, "profile": "2g.10gb"},
        {"uuid": "", "gi": 2, "profile": "1g.5gb"},
    ]
    assert "mig_instances" not in caps["1"]  # not in MIG mode: nothing to list
    assert "hami_capable" not in caps["0"]  # not a Hygon card: not known, not "false"
    validate({"gpu_capabilities": caps})


def test_a_mig_card_without_instances_reports_an_empty_list(cards, validate):
    cards.nvidia()
    caps = detector(cards).detect().capabilities
    assert caps["0"]["mig_instances"] == []
    validate({"gpu_capabilities": caps})


def test_a_listing_that_fails_reports_no_instances_at_all(cards):
    """Absent is "not known": the server's orphan GC must not read it as "none there"."""
    cards.nvidia()
    cards.install("nvidia-smi", "nvidia_smi.py")
    state = cards.read()
    state["gpus"][0]["model"] = "NVIDIA A100-SXM4-40GB"
    cards.write(state)
    (cards.root / "usr/bin/nvidia-smi").write_text(
        (cards.root / "usr/bin/nvidia-smi")
        .read_text()
        .replace("exec(", "import sys\nif sys.argv[1:2] == ['mig']: sys.exit(255)\nexec(")
    )
    caps = detector(cards).detect().capabilities
    assert caps["0"]["mig_capable"] is True
    assert "mig_instances" not in caps["0"]


def test_in_a_container_no_instances_are_listed(cards):
    cards.nvidia()
    caps = detector(cards, container=True).detect().capabilities
    assert "mig_instances" not in caps["0"]
    assert not [c for c in cards.calls("mig")]


def test_a_hygon_card_with_the_vdcu_tool_is_hami_capable(cards, validate):
    cards.hygon()
    result = detector(cards).detect()
    assert result.vendor == "hygon"
    assert result.capabilities["0"] == {
        "mig_capable": False,
        "mps_capable": False,
        "best_tier": 2,
        "hami_capable": True,
    }
    validate({"gpu_capabilities": result.capabilities})
    cards.update(virtual_broken=True)
    assert result.capabilities["0"]["hami_capable"] is True  # the last beat's, unchanged
    assert detector(cards).detect().capabilities["0"]["hami_capable"] is False


def test_a_hygon_node_in_a_container_carves_nothing(cards):
    cards.hygon()
    caps = detector(cards, container=True).detect().capabilities
    assert caps["0"]["hami_capable"] is False and caps["0"]["best_tier"] == 9
