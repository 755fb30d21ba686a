"""Choosing the vendor, the virtual fallback, caching between beats, and what a lost
card or a failed tool looks like for vendors with partial or no attribution."""

from __future__ import annotations

import pytest

import heteroflow_agent.detect as detect_module
from heteroflow_agent.detect import detect

from .conftest import fixture_text, rule


def test_no_vendor_tool_is_one_virtual_card(host, validate):
    result = host.detector().detect()
    assert (result.vendor, result.virtual, result.collector_error) == ("virtual", True, "")
    assert result.gpus == [{"index": 0, "vendor": "virtual", "model": "Virtual GPU", "metrics_available": []}]
    assert result.capabilities == {"0": {"mig_capable": False, "mps_capable": False, "best_tier": 9}}
    validate(result.heartbeat_fields())


def test_domestic_vendors_come_first(host):
    host.tool("nvidia-smi", rule("nvidia/query_8x_a100.csv"))
    host.tool("npu-smi", rule("ascend/info_8x_910b3.txt"), at=None)
    assert host.detector().detect().vendor == "ascend"
    host.tool("mthreads-gmi", rule("musa/mthreads-gmi_1x_s80.txt"), at="usr/local/bin")
    assert host.detector().detect().vendor == "musa"


def test_hygon_is_claimed_before_amd_on_a_dtk_node(host):
    host.tool("rocm-smi", rule("amd/rocm-smi_2x_mi210.json"), at="opt/rocm/bin")
    host.tool("hy-smi", rule("hygon/hy-smi_1x_z100l.json"), at="opt/hyhal/bin")
    assert host.detector().detect().vendor == "hygon"


def test_amd_falls_back_to_rocm_smi(host, validate):
    host.tool("rocm-smi", rule("amd/rocm-smi_2x_mi210.json"), at="opt/rocm/bin")
    result = host.detector().detect()
    assert result.vendor == "amd" and result.tool.endswith("rocm-smi")
    assert result.gpus[1] == {
        "index": 1,
        "vendor": "amd",
        "uuid": "0x5c88007d760374f4",
        "model": "Instinct MI210",
        "memory_total_mb": 65520,
        "utilization": 98,
        "memory_used_mb": 57344,
        "temperature": 36,
        "power_w": 277,
        "metrics_available": ["utilization", "memory_used_mb", "temperature", "power_w"],
    }
    validate(result.heartbeat_fields())


@pytest.mark.parametrize(
    "fixture, expected",
    [
        (
            "amd/rocm-smi_1x_rx7800xt.json",
            {
                "model": "Navi 32 [Radeon RX 7700 XT / 7800 XT]",
                "memory_total_mb": 16368,
                "memory_used_mb": 11077,
                "utilization": 100,
                "temperature": 45,
                "power_w": 53,
            },
        ),
        ("amd/rocm-smi_missing_fields.json", {"model": "Instinct MI100", "memory_total_mb": 32752}),
    ],
)
def test_rocm_smi_one_card_and_missing_fields(host, fixture, expected):
    host.tool("rocm-smi", rule(fixture), at="opt/rocm/bin")
    [card] = host.detector().detect().gpus
    assert {k: v for k, v in card.items() if k not in ("index", "vendor", "uuid", "metrics_available")} == expected


def test_a_tool_that_fails_still_claims_the_machine(host):
    """A broken driver on a GPU server must not pass for a GPU-less machine."""
    host.tool("npu-smi", rule("ascend/dcmi_failed.txt", code=255))
    result = host.detector().detect()
    assert (result.vendor, result.virtual, result.gpus) == ("ascend", False, [])
    assert (
        result.collector_error
        == "npu-smi exited with status 255: dcmi model initialized failed, because the device is used. ret is -8020"
    )


def test_a_tool_that_says_no_devices_lets_the_chain_go_on(host):
    host.tool("ixsmi", rule(text="No devices were found\n", code=6))
    host.tool("mx-smi", rule("metax/mx-smi_1x_c550.txt"))
    assert host.detector().detect().vendor == "metax"


def test_intel_xpu_smi_is_not_kunlun(host):
    host.tool("xpu-smi", rule(text="Intel(R) XPU System Management Interface -- v1.2\n"))
    assert host.detector().detect().virtual
    host.file("dev/xpu0")
    assert host.detector().detect().vendor == "kunlun"


def test_xpu_smi_underscore_name_needs_no_device_check(host):
    host.tool("xpu_smi", rule("kunlun/xpu-smi_1x_r200.txt"), at="usr/local/xpu/bin")
    assert host.detector().detect().vendor == "kunlun"


def test_the_vendor_is_found_once_and_then_only_its_tool_runs(host):
    host.tool("nvidia-smi", rule("nvidia/no_devices.txt", code=6))
    host.tool("cnmon", rule("cambricon/cnmon_info_4x_mlu370x4.txt"))
    detector = host.detector()
    for _ in range(4):
        assert detector.detect().vendor == "cambricon"
    assert len(host.calls("cnmon")) == 4 and host.calls("nvidia-smi") == []


def test_a_virtual_machine_looks_again_later_for_a_driver_installed_since(host):
    detector = host.detector(rescan_every=3)
    assert detector.detect().virtual
    host.tool("hy-smi", rule("hygon/hy-smi_1x_z100l.json"))
    assert detector.detect().virtual and detector.detect().virtual  # not yet due
    assert detector.detect().vendor == "hygon"


def test_the_tool_disappearing_later_is_a_collector_error_not_a_virtual_gpu(host, validate):
    tool = host.tool("efsmi", rule("enflame/efsmi_q_8x_s60.txt"))
    detector = host.detector()
    assert len(detector.detect().gpus) == 8
    tool.unlink()
    result = detector.detect()
    assert (result.vendor, result.virtual, result.gpus) == ("enflame", False, [])
    assert result.collector_error == f"efsmi is no longer at {tool}"
    validate(result.heartbeat_fields())


def _drop_card(text_rel: str, start: str, stop: str) -> str:
    """The recorded output with one card's block cut out (start line up to stop line)."""
    lines = fixture_text(text_rel).splitlines(keepends=True)
    i = next(n for n, line in enumerate(lines) if line.startswith(start))
    j = next(n for n in range(i + 1, len(lines)) if lines[n].startswith(stop))
    return "".join(lines[:i] + lines[j:])


@pytest.mark.parametrize(
    "tool, fixture, cut, lost, at",
    [
        ("npu-smi", "ascend/info_8x_910b3.txt", ("| 3     910B3", "| 4     910B3"), 3, "usr/bin"),
        ("cnmon", "cambricon/cnmon_info_4x_mlu370x4.txt", ("Card 1", "Card 2"), 1, "usr/bin"),
        ("xpu_smi", "kunlun/xpu-smi_8x_r300.txt", ("|     6 |", "|     7 |"), 6, "usr/bin"),
    ],
)
def test_partial_vendors_name_a_card_missing_while_others_answer(host, validate, tool, fixture, cut, lost, at):
    host.tool(tool, rule(fixture), at=at)
    detector = host.detector()
    before = detector.detect()
    host.tool(tool, rule(text=_drop_card(fixture, *cut)), at=at)
    result = detector.detect()
    assert [g["index"] for g in result.gpus] == [g["index"] for g in before.gpus if g["index"] != lost]
    [failure] = result.collect_failures
    assert failure["index"] == lost and "did not report this card" in failure["error"]
    if tool == "cnmon":
        assert failure["uuid"] == before.gpus[lost]["uuid"]
    validate(result.heartbeat_fields())


def test_partial_vendor_with_every_card_gone_is_a_collector_error(host):
    host.tool("npu-smi", rule("ascend/info_1x_910b4.txt"))
    detector = host.detector()
    detector.detect()
    host.tool("npu-smi", rule("ascend/empty.txt", code=1))
    result = detector.detect()
    assert result.gpus == [] and result.collect_failures == [] and result.collector_error


def test_position_vendors_never_blame_a_card(host):
    host.tool("mx-smi", rule("metax/mx-smi_8x_c500.txt"))
    detector = host.detector()
    detector.detect()
    host.tool("mx-smi", rule(text=_drop_card("metax/mx-smi_8x_c500.txt", "| 3 ", "| 4 ")))
    result = detector.detect()
    assert len(result.gpus) == 7 and result.collect_failures == []
    assert result.failure_attribution == "none"


def test_module_level_detect_keeps_its_detector(host):
    host.tool("cnmon", rule("cambricon/cnmon_info_1x_mlu370s4.txt"))
    first = detect(root=str(host.root), timeout=5, is_container=False)
    host.tool("nvidia-smi", rule("nvidia/query_8x_a100.csv"))  # appears later: the choice stands
    second = detect(root=str(host.root), timeout=5, is_container=False)
    assert first.vendor == second.vendor == "cambricon"
    assert len(host.calls("cnmon")) == 2 and host.calls("nvidia-smi") == []
    detect_module._detectors.clear()


def test_heartbeat_fields_leave_out_an_empty_collector_error(host):
    fields = host.detector().detect().heartbeat_fields()
    assert "gpu_collector_error" not in fields
    assert set(fields) == {
        "gpu_stats",
        "gpu_collect_failures",
        "gpu_capabilities",
        "gpu_index_basis",
        "labels",
        "is_container",
    }


def test_a_bug_costs_the_gpu_part_of_one_beat_not_the_beat(host, monkeypatch, validate):
    from heteroflow_agent.detect.ascend import AscendTool

    host.tool("npu-smi", rule("ascend/info_1x_910b4.txt"))
    detector = host.detector()
    assert len(detector.detect().gpus) == 1

    def broken(self, path, run, *, slicing=False):
        raise RuntimeError("boom")

    monkeypatch.setattr(AscendTool, "read", broken)
    result = detector.detect()
    assert (result.vendor, result.gpus) == ("ascend", [])
    assert result.collector_error == "gpu detection failed: RuntimeError: boom"
    validate(result.heartbeat_fields())
