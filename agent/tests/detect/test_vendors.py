"""Every vendor, detected for real through a stand-in tool printing recorded output:
several cards, one card, cards with fields the tool could not give, garbage, nothing
at all, and a tool that hangs. Each result must also fit the heartbeat schema."""

from __future__ import annotations

import os
import time

import pytest

from heteroflow_agent.detect import MATRIX

from .conftest import rule

METRIC_KEYS = ("utilization", "memory_used_mb", "temperature", "power_w")


def _xpu_nodes(host):
    for i in range(8):
        host.file(f"dev/xpu{i}")


# vendor: where its tool is installed, and what each recorded output must yield.
# "multi" = (rules, card count, index of a sample card, expected fields of that card)
# "missing" = {card index: (fields present, fields absent)}
VENDORS = {
    "nvidia": dict(
        tool="nvidia-smi",
        at="usr/lib/wsl/lib",
        multi=(
            [
                rule("nvidia/query_8x_a100.csv", when=["--query-gpu="]),
                rule("nvidia/q_8x_a100.txt", when=["-q"]),
                rule("nvidia/topo_8x_nvswitch.txt", when=["topo", "-m"]),
            ],
            8,
            2,
            {
                "model": "NVIDIA A100-SXM4-80GB",
                "memory_total_mb": 81920,
                "memory_used_mb": 40213,
                "utilization": 97,
                "temperature": 58,
                "power_w": 388.12,
                "compute_capability": "8.0",
            },
        ),
        one=(
            [
                rule("nvidia/query_1x_rtx4060_wsl.csv", when=["--query-gpu="]),
                rule("nvidia/q_1x_rtx4060_wsl.txt", when=["-q"]),
                rule("nvidia/topo_2x_pcie.txt", when=["topo", "-m"]),
            ],
            {
                "model": "NVIDIA GeForce RTX 4060 Laptop GPU",
                "memory_total_mb": 8188,
                "memory_used_mb": 1320,
                "utilization": 7,
                "temperature": 46,
                "power_w": 12.91,
                "compute_capability": "8.9",
            },
        ),
        missing=(
            "nvidia/query_missing_fields.csv",
            {
                0: (["memory_used_mb", "temperature", "power_w"], ["utilization"]),
                1: (["utilization", "temperature"], ["power_w"]),
                2: (["memory_total_mb"], list(METRIC_KEYS)),
            },
        ),
        garbage="nvidia/garbage.txt",
    ),
    "ascend": dict(
        tool="npu-smi",
        at="usr/local/sbin",
        multi=(
            [rule("ascend/info_8x_910b3.txt")],
            8,
            2,
            {"model": "910B3", "memory_total_mb": 65536, "memory_used_mb": 52110, "utilization": 87, "temperature": 37},
        ),
        one=(
            [rule("ascend/info_1x_910b4.txt")],
            {"model": "910B4", "memory_total_mb": 32768, "memory_used_mb": 8822, "utilization": 12, "temperature": 41},
        ),
        missing=(
            "ascend/info_missing_fields.txt",
            {
                0: ([], list(METRIC_KEYS) + ["memory_total_mb"]),
                1: (["utilization", "memory_used_mb", "temperature"], ["power_w"]),
            },
        ),
        garbage="ascend/garbage.txt",
    ),
    "hygon": dict(
        tool="hy-smi",
        at="opt/hyhal/bin",
        multi=(
            [rule("hygon/hy-smi_8x_k100ai.json")],
            8,
            2,
            {
                "model": "K100_AI",
                "memory_total_mb": 65520,
                "memory_used_mb": 60118,
                "utilization": 93,
                "temperature": 39,
                "power_w": 95,
            },
        ),
        one=(
            [rule("hygon/hy-smi_1x_z100l.json")],
            {
                "model": "Z100L",
                "memory_total_mb": 32752,
                "memory_used_mb": 1024,
                "utilization": 4,
                "temperature": 38,
                "power_w": 38,
            },
        ),
        missing=(
            "hygon/hy-smi_missing_fields.json",
            {0: (["memory_total_mb"], list(METRIC_KEYS)), 1: (list(METRIC_KEYS), [])},
        ),
        garbage="hygon/garbage.json",
    ),
    "cambricon": dict(
        tool="cnmon",
        at=None,
        multi=(
            [rule("cambricon/cnmon_info_4x_mlu370x4.txt")],
            4,
            2,
            {
                "model": "MLU370-X4",
                "memory_total_mb": 24576,
                "memory_used_mb": 23004,
                "utilization": 99,
                "temperature": 41,
                "power_w": 141,
            },
        ),
        one=(
            [rule("cambricon/cnmon_info_1x_mlu370s4.txt")],
            {
                "model": "MLU370-S4",
                "memory_total_mb": 24576,
                "memory_used_mb": 512,
                "utilization": 3,
                "temperature": 37,
                "power_w": 22,
            },
        ),
        missing=(
            "cambricon/cnmon_info_missing_fields.txt",
            {
                0: (["memory_used_mb"], ["utilization", "temperature", "power_w"]),
                1: (["utilization", "temperature", "power_w"], ["memory_used_mb"]),
            },
        ),
        garbage="cambricon/garbage.txt",
    ),
    "biren": dict(
        tool="brsmi",
        at="usr/local/bin",
        multi=(
            [rule("biren/brsmi_8x_106m.txt")],
            8,
            2,
            {"model": "Biren 106M", "memory_total_mb": 32512, "memory_used_mb": 30001, "utilization": 95},
        ),
        one=(
            [rule("biren/brsmi_1x_br104.txt")],
            {"model": "Biren BR104", "memory_total_mb": 32512, "memory_used_mb": 2048, "utilization": 2},
        ),
        missing=(
            "biren/brsmi_missing_fields.txt",
            {
                0: (["memory_total_mb"], list(METRIC_KEYS)),
                1: (["utilization", "memory_used_mb"], ["temperature", "power_w"]),
            },
        ),
        garbage="biren/garbage.txt",
    ),
    "kunlun": dict(
        tool="xpu-smi",
        at=None,
        setup=_xpu_nodes,
        multi=(
            [rule("kunlun/xpu-smi_8x_r300.txt")],
            8,
            2,
            {
                "model": "R300",
                "memory_total_mb": 32768,
                "memory_used_mb": 30110,
                "utilization": 97,
                "temperature": 36,
                "power_w": 241,
            },
        ),
        one=(
            [rule("kunlun/xpu-smi_1x_r200.txt")],
            {
                "model": "R200",
                "memory_total_mb": 16384,
                "memory_used_mb": 1024,
                "utilization": 5,
                "temperature": 38,
                "power_w": 55,
            },
        ),
        missing=(
            "kunlun/xpu-smi_missing_fields.txt",
            {0: (["memory_total_mb"], list(METRIC_KEYS)), 1: (list(METRIC_KEYS), [])},
        ),
        garbage="kunlun/garbage.txt",
    ),
    "iluvatar": dict(
        tool="ixsmi",
        at="usr/local/corex/bin",
        multi=(
            [rule("iluvatar/ixsmi_8x_biv150.csv")],
            8,
            2,
            {
                "model": "Iluvatar BI-V150",
                "memory_total_mb": 32768,
                "memory_used_mb": 27996,
                "utilization": 98,
                "temperature": 32,
                "power_w": 201,
            },
        ),
        one=(
            [rule("iluvatar/ixsmi_1x_mrv100.csv")],
            {
                "model": "Iluvatar MR-V100",
                "memory_total_mb": 32768,
                "memory_used_mb": 2048,
                "utilization": 14,
                "temperature": 36,
                "power_w": 61,
            },
        ),
        missing=(
            "iluvatar/ixsmi_missing_fields.csv",
            {
                0: (["memory_used_mb"], ["utilization", "temperature", "power_w"]),
                1: (["utilization", "temperature", "power_w"], ["memory_used_mb", "uuid"]),
            },
        ),
        garbage="iluvatar/garbage.csv",
    ),
    "musa": dict(
        tool="mthreads-gmi",
        at="usr/bin",
        multi=(
            [rule("musa/mthreads-gmi_8x_s4000.txt")],
            8,
            2,
            {
                "model": "MTT S4000",
                "memory_total_mb": 49152,
                "memory_used_mb": 47001,
                "utilization": 99,
                "temperature": 44,
            },
        ),
        one=(
            [rule("musa/mthreads-gmi_1x_s80.txt")],
            {"model": "MTT S80", "memory_total_mb": 16384, "memory_used_mb": 1339, "utilization": 3, "temperature": 56},
        ),
        missing=(
            "musa/mthreads-gmi_missing_fields.txt",
            {
                0: (["memory_total_mb"], list(METRIC_KEYS)),
                1: (["utilization", "memory_used_mb", "temperature"], ["power_w"]),
            },
        ),
        garbage="musa/garbage.txt",
    ),
    "metax": dict(
        tool="mx-smi",
        at="opt/mxdriver/bin",
        multi=(
            [rule("metax/mx-smi_8x_c500.txt")],
            8,
            2,
            {
                "model": "MetaX C500",
                "memory_total_mb": 65536,
                "memory_used_mb": 61201,
                "utilization": 96,
                "temperature": 38,
                "power_w": 331,
            },
        ),
        one=(
            [rule("metax/mx-smi_1x_c550.txt")],
            {
                "model": "MetaX C550",
                "memory_total_mb": 65536,
                "memory_used_mb": 2048,
                "utilization": 5,
                "temperature": 40,
                "power_w": 80,
            },
        ),
        missing=(
            "metax/mx-smi_missing_fields.txt",
            {0: (["memory_total_mb"], list(METRIC_KEYS)), 1: (list(METRIC_KEYS), [])},
        ),
        garbage="metax/garbage.txt",
    ),
    "enflame": dict(
        tool="efsmi",
        at="opt/efsmi/bin",
        multi=(
            [rule("enflame/efsmi_q_8x_s60.txt", when=["-q"])],
            8,
            2,
            {
                "model": "Enflame S60",
                "memory_total_mb": 49152,
                "memory_used_mb": 46002,
                "utilization": 99,
                "temperature": 36,
                "power_w": 251.2,
            },
        ),
        one=(
            [rule("enflame/efsmi_q_1x_t20.txt", when=["-q"])],
            {
                "model": "Enflame T20",
                "memory_total_mb": 32768,
                "memory_used_mb": 2111,
                "utilization": 1,
                "temperature": 33,
                "power_w": 45,
            },
        ),
        missing=(
            "enflame/efsmi_q_missing_fields.txt",
            {0: (["memory_total_mb"], list(METRIC_KEYS)), 1: (list(METRIC_KEYS), [])},
        ),
        garbage="enflame/garbage.txt",
    ),
    "amd": dict(
        tool="amd-smi",
        at="opt/rocm/bin",
        multi=(
            [
                rule("amd/amd-smi_static_8x_mi300x.json", when=["static"]),
                rule("amd/amd-smi_metric_8x_mi300x.json", when=["metric"]),
            ],
            8,
            2,
            {
                "model": "AMD Instinct MI300X",
                "memory_total_mb": 196592,
                "memory_used_mb": 190001,
                "utilization": 100,
                "temperature": 42,
                "power_w": 702,
            },
        ),
        one=(
            [
                rule("amd/amd-smi_static_1x_w7900.json", when=["static"]),
                rule("amd/amd-smi_metric_1x_w7900.json", when=["metric"]),
            ],
            {
                "model": "AMD Radeon PRO W7900",
                "memory_total_mb": 49152,
                "memory_used_mb": 2048,
                "utilization": 12,
                "temperature": 42,
                "power_w": 61,
            },
        ),
        missing=(
            "amd/amd-smi_metric_missing_fields.json",
            {0: (["memory_total_mb"], list(METRIC_KEYS) + ["model"]), 1: (list(METRIC_KEYS), [])},
        ),
        garbage="amd/garbage.json",
    ),
}


def test_every_detected_vendor_has_recorded_outputs():
    assert set(VENDORS) == set(MATRIX) - {"virtual"}


def _install(host, vendor, *rules):
    case = VENDORS[vendor]
    if case.get("setup"):
        case["setup"](host)
    host.tool(case["tool"], *rules, at=case["at"])


def _expect_metrics(card, vendor):
    present = [k for k in METRIC_KEYS if k in card]
    assert card["metrics_available"] == present, "metrics_available lists exactly the metrics sent"
    assert set(present) <= MATRIX[vendor].metrics, "only metrics the capability matrix allows"


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_several_cards(host, validate, vendor):
    rules, count, sample, expected = VENDORS[vendor]["multi"]
    _install(host, vendor, *rules)
    result = host.detector().detect()
    assert (result.vendor, result.collector_error, result.virtual) == (vendor, "", False)
    assert [g["index"] for g in result.gpus] == list(range(count))
    card = result.gpus[sample]
    assert {k: card.get(k) for k in expected} == expected
    assert card["vendor"] == vendor
    for gpu in result.gpus:
        _expect_metrics(gpu, vendor)
    assert result.collect_failures == []
    validate(result.heartbeat_fields())


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_one_card(host, validate, vendor):
    rules, expected = VENDORS[vendor]["one"]
    _install(host, vendor, *rules)
    result = host.detector().detect()
    assert (result.vendor, result.collector_error) == (vendor, "")
    assert len(result.gpus) == 1
    card = result.gpus[0]
    assert card["index"] == 0
    assert {k: card.get(k) for k in expected} == expected
    _expect_metrics(card, vendor)
    validate(result.heartbeat_fields())


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_fields_the_tool_did_not_give_are_absent_not_zero(host, validate, vendor):
    fixture, cards = VENDORS[vendor]["missing"]
    _install(host, vendor, rule(fixture))
    result = host.detector().detect()
    assert (result.vendor, result.collector_error) == (vendor, "")
    by_index = {g["index"]: g for g in result.gpus}
    assert set(by_index) == set(cards)
    for index, (present, absent) in cards.items():
        card = by_index[index]
        allowed = [k for k in present if k not in METRIC_KEYS or k in MATRIX[vendor].metrics]
        assert all(k in card for k in allowed), (index, card)
        assert not any(k in card for k in absent), (index, card)
        _expect_metrics(card, vendor)
    validate(result.heartbeat_fields())


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_garbage_is_a_collector_error_not_a_machine_without_cards(host, validate, vendor):
    _install(host, vendor, rule(VENDORS[vendor]["garbage"]))
    result = host.detector().detect()
    assert result.vendor == vendor and not result.virtual
    assert result.gpus == [] and result.collection_failed
    assert "could not parse" in result.collector_error
    validate(result.heartbeat_fields())


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_empty_output_is_a_collector_error(host, validate, vendor):
    _install(host, vendor, rule(f"{vendor}/empty.txt"))
    result = host.detector().detect()
    assert result.vendor == vendor
    assert result.gpus == [] and result.capabilities == {}
    assert result.collector_error.endswith("printed nothing")
    validate(result.heartbeat_fields())


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_a_hung_tool_is_killed_and_reported(host, tmp_path, validate, vendor):
    pid_file = tmp_path / "standin.pid"
    _install(host, vendor, rule(sleep=60, pid_file=pid_file))
    started = time.monotonic()
    result = host.detector(timeout=0.5).detect()
    assert time.monotonic() - started < 10
    assert result.vendor == vendor and result.gpus == []
    assert "timed out after 0.5s and was killed" in result.collector_error
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    validate(result.heartbeat_fields())
