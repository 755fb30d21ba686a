"""NVIDIA: UUID-checked cards with per-card failures, MIG from `nvidia-smi -q`, NVLink
and NUMA from `nvidia-smi topo -m`, and the thin NVML path."""

from __future__ import annotations

import json
import sys
import types

import pytest

from heteroflow_agent.detect.nvidia import QUERY_FIELDS, TOPOLOGY_LABEL, parse_topology, topology_label

from .conftest import fixture_text, rule

QUERY = "--query-gpu="
A100 = [line.split(", ")[1] for line in fixture_text("nvidia/query_8x_a100.csv").splitlines()]
STANDARD = [rule("nvidia/q_8x_a100.txt", when=["-q"]), rule("nvidia/topo_8x_nvswitch.txt", when=["topo", "-m"])]


def eight_cards(host, *extra):
    host.tool("nvidia-smi", *extra, rule("nvidia/query_8x_a100.csv", when=[QUERY]), *STANDARD)


def test_a_card_that_falls_off_the_bus_is_named_by_its_uuid_and_the_others_keep_their_index(host, validate):
    detector = host.detector()
    eight_cards(host)
    assert [g["uuid"] for g in detector.detect().gpus] == A100
    # card 5 is gone: nvidia-smi renumbers the cards after it and exits non-zero
    host.tool(
        "nvidia-smi",
        rule("nvidia/probe_card5_lost.txt", when=[QUERY, "-i"], code=15),
        rule("nvidia/query_8x_a100_card5_gone.csv", when=[QUERY], code=15),
        *STANDARD,
    )
    result = detector.detect()
    assert result.collector_error == ""
    assert [(g["index"], g["uuid"]) for g in result.gpus] == [(i, A100[i]) for i in (0, 1, 2, 3, 4, 6, 7)]
    assert result.gpus[5]["memory_used_mb"] == 78100  # card 7's readings stay card 7's
    [failure] = result.collect_failures
    assert (failure["index"], failure["uuid"]) == (5, A100[5])
    assert "GPU is lost" in failure["error"]
    assert "5" not in result.capabilities
    probes = [call for call in host.calls("nvidia-smi") if "-i" in call]
    assert probes == [[f"{QUERY}{','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits", "-i", A100[5]]]
    validate(result.heartbeat_fields())


def test_a_card_the_tool_marks_lost_is_a_failure_without_a_probe(host, validate):
    detector = host.detector()
    eight_cards(host)
    detector.detect()
    host.tool("nvidia-smi", rule("nvidia/query_8x_a100_card2_lost.csv", when=[QUERY]), *STANDARD)
    result = detector.detect()
    assert [g["index"] for g in result.gpus] == [0, 1, 3, 4, 5, 6, 7]
    assert result.collect_failures == [{"index": 2, "uuid": A100[2], "error": "[GPU is lost]"}]
    assert not [call for call in host.calls("nvidia-smi") if "-i" in call]
    validate(result.heartbeat_fields())


def test_a_lost_card_on_the_first_reading_is_still_reported(host):
    """Its UUID was readable, so it is a known card from the start."""
    host.tool("nvidia-smi", rule("nvidia/query_8x_a100_card2_lost.csv", when=[QUERY]), *STANDARD)
    result = host.detector().detect()
    assert [f["index"] for f in result.collect_failures] == [2]


def test_a_missing_card_that_answers_on_its_own_is_kept(host):
    detector = host.detector()
    eight_cards(host)
    detector.detect()
    five = fixture_text("nvidia/query_8x_a100.csv").splitlines()[5]
    host.tool(
        "nvidia-smi",
        rule(text=five + "\n", when=[QUERY, "-i"]),
        rule("nvidia/query_8x_a100_card5_gone.csv", when=[QUERY], code=15),
        *STANDARD,
    )
    result = detector.detect()
    assert [g["index"] for g in result.gpus] == list(range(8)) and result.collect_failures == []


def test_a_hung_probe_is_not_repeated_for_every_missing_card(host):
    detector = host.detector(timeout=2.0)
    eight_cards(host)
    detector.detect()
    host.tool(
        "nvidia-smi",
        rule(sleep=30, when=[QUERY, "-i"]),
        rule(text="\n".join(fixture_text("nvidia/query_8x_a100.csv").splitlines()[:5]) + "\n", when=[QUERY]),
        *STANDARD,
    )
    result = detector.detect()
    assert [f["index"] for f in result.collect_failures] == [5, 6, 7]
    assert "timed out" in result.collect_failures[0]["error"]
    assert result.collect_failures[1]["error"] == "not reported by nvidia-smi"
    assert len([c for c in host.calls("nvidia-smi") if "-i" in c]) == 1


def test_nvidia_smi_failing_as_a_whole_is_not_every_card_gone(host, validate):
    detector = host.detector()
    eight_cards(host)
    detector.detect()
    host.tool("nvidia-smi", rule("nvidia/driver_failed.txt", code=9))
    result = detector.detect()
    assert result.gpus == [] and result.collect_failures == []
    assert result.collector_error.startswith("nvidia-smi exited with status 9: NVIDIA-SMI has failed")
    assert result.labels[TOPOLOGY_LABEL]  # what is known about the machine stays
    validate(result.heartbeat_fields())
    eight_cards(host)
    assert len(detector.detect().gpus) == 8  # and it recovers


def test_a_row_with_an_unreadable_uuid_is_not_a_new_card(host):
    detector = host.detector()
    eight_cards(host)
    detector.detect()
    rows = fixture_text("nvidia/query_8x_a100.csv").splitlines()
    rows[3] = (
        "3, [Unknown Error], NVIDIA A100-SXM4-80GB, [Unknown Error], [Unknown Error], "
        "[Unknown Error], [Unknown Error], [Unknown Error], 8.0"
    )
    host.tool(
        "nvidia-smi",
        rule(
            text="Unable to determine the device handle for gpu " + A100[3] + ": Unknown Error\n",
            when=[QUERY, "-i"],
            code=15,
        ),
        rule(text="\n".join(rows) + "\n", when=[QUERY], code=15),
        *STANDARD,
    )
    result = detector.detect()
    assert [g["index"] for g in result.gpus] == [0, 1, 2, 4, 5, 6, 7]
    assert [(f["index"], f["uuid"]) for f in result.collect_failures] == [(3, A100[3])]
    assert "Unknown Error" in result.collect_failures[0]["error"]


def test_a_driver_without_compute_cap_is_asked_without_it(host):
    fields = ",".join(QUERY_FIELDS[:-1])
    row = fixture_text("nvidia/query_1x_rtx4060_wsl.csv").rsplit(", ", 1)[0] + "\n"
    host.tool(
        "nvidia-smi",
        rule(text=row, when=[f"{QUERY}{fields}"]),
        rule("nvidia/invalid_field.txt", when=[QUERY], code=2),
        rule("nvidia/q_1x_rtx4060_wsl.txt", when=["-q"]),
        rule("nvidia/topo_2x_pcie.txt", when=["topo", "-m"]),
    )
    detector = host.detector()
    first = detector.detect()
    assert first.collector_error == "" and "compute_capability" not in first.gpus[0]
    assert first.gpus[0]["memory_total_mb"] == 8188
    before = len(host.calls("nvidia-smi"))
    detector.detect()
    queries = [c for c in host.calls("nvidia-smi")[before:] if c[0].startswith(QUERY)]
    assert queries == [[f"{QUERY}{fields}", "--format=csv,noheader,nounits"]]


def test_mig_is_offered_only_where_the_mode_is_enabled_now(host, validate):
    eight_cards(host)
    caps = host.detector().detect().capabilities
    # 0-3 partitioned; 4 enabled but pending a reset (not yet); 5 disabling (still on); 6, 7 off
    assert [caps[str(i)]["mig_capable"] for i in range(8)] == [True, True, True, True, False, True, False, False]
    assert [caps[str(i)]["best_tier"] for i in range(8)] == [1, 1, 1, 1, 9, 1, 9, 9]
    assert not any(c["mps_capable"] for c in caps.values())


def test_a_card_without_mig_reports_none(host):
    host.tool(
        "nvidia-smi",
        rule("nvidia/query_1x_rtx4060_wsl.csv", when=[QUERY]),
        rule("nvidia/q_1x_rtx4060_wsl.txt", when=["-q"]),
        rule("nvidia/topo_2x_pcie.txt", when=["topo", "-m"]),
    )
    assert host.detector().detect().capabilities == {"0": {"mig_capable": False, "mps_capable": False, "best_tier": 9}}


def test_no_mig_when_nvidia_smi_q_fails(host):
    host.tool(
        "nvidia-smi",
        rule("nvidia/query_8x_a100.csv", when=[QUERY]),
        rule(text="", when=["-q"], code=1),
        rule("nvidia/topo_8x_nvswitch.txt", when=["topo", "-m"]),
    )
    caps = host.detector().detect().capabilities
    assert not any(c["mig_capable"] for c in caps.values())


def test_a_live_mps_daemon_makes_every_card_mps_capable(host):
    host.file("proc/4242/comm", "nvidia-cuda-mps\n")
    host.file("proc/4242/cmdline", b"nvidia-cuda-mps-control\x00-d\x00")
    eight_cards(host)
    caps = host.detector().detect().capabilities
    assert all(c["mps_capable"] for c in caps.values())
    assert [caps[str(i)]["best_tier"] for i in range(8)] == [1, 1, 1, 1, 2, 1, 2, 2]


def test_the_mps_bit_is_dropped_on_the_beat_after_the_daemon_dies(host):
    comm = host.file("proc/4242/comm", "nvidia-cuda-mps\n")
    host.file("proc/4242/cmdline", b"nvidia-cuda-mps-control\x00-d\x00")
    eight_cards(host)
    detector = host.detector()
    assert detector.detect().capabilities["7"]["mps_capable"]
    comm.unlink()
    (host.root / "proc/4242/cmdline").unlink()
    (host.root / "proc/4242").rmdir()
    assert detector.detect().capabilities["7"] == {"mig_capable": False, "mps_capable": False, "best_tier": 9}


def test_in_a_container_only_software_accounting_and_no_mig_query(host):
    host.file("proc/4242/comm", "nvidia-cuda-mps\n")
    host.file("proc/4242/cmdline", b"nvidia-cuda-mps-control\x00")
    eight_cards(host)
    result = host.detector(is_container=True).detect()
    assert result.is_container
    assert set(map(json.dumps, result.capabilities.values())) == {
        json.dumps({"mig_capable": False, "mps_capable": False, "best_tier": 9})
    }
    assert ["-q"] not in host.calls("nvidia-smi")


def test_one_or_two_runs_per_beat(host):
    """The first beat also reads the topology and the cards' health (-q -d ECC,... and
    the bus ids; every 30 s, not per beat); after that, the query and -q only, plus the
    MIG instance listing on a node with cards in MIG mode (here it fails at its first
    call, `mig -lgi`, and is not pursued)."""
    eight_cards(host)
    detector = host.detector(clock=lambda: 0.0)
    detector.detect()
    calls = [c[0] for c in host.calls("nvidia-smi")]
    assert calls == [f"{QUERY}{','.join(QUERY_FIELDS)}", "-q", "mig", "topo", "-q", f"{QUERY}index,uuid,pci.bus_id"]
    before = len(host.calls("nvidia-smi"))
    for _ in range(3):
        detector.detect()
    assert len(host.calls("nvidia-smi")) - before == 9


def test_topology_label(host):
    host.tool(
        "nvidia-smi",
        rule("nvidia/query_8x_a100.csv", when=[QUERY]),
        rule("nvidia/q_8x_a100.txt", when=["-q"]),
        rule("nvidia/topo_4x_bridges.txt", when=["topo", "-m"]),
    )
    labels = host.detector().detect().labels
    assert labels == {TOPOLOGY_LABEL: '{"nvlink":[[0,1],[1,2]],"numa":{"0":0,"1":0,"2":0,"3":1}}'}


@pytest.mark.parametrize(
    "fixture, nvlink, numa",
    [
        (
            "topo_8x_nvswitch.txt",
            [[a, b] for a in range(8) for b in range(a + 1, 8)],
            {str(i): 0 if i < 4 else 1 for i in range(8)},
        ),
        ("topo_4x_bridges.txt", [[0, 1], [1, 2]], {"0": 0, "1": 0, "2": 0, "3": 1}),
        ("topo_2x_pcie.txt", [], {}),
        ("topo_2x_old_driver.txt", [[0, 1]], {}),
    ],
)
def test_topology_outputs(fixture, nvlink, numa):
    assert parse_topology(fixture_text(f"nvidia/{fixture}")) == {"nvlink": nvlink, "numa": numa}


@pytest.mark.parametrize("text", ["", "garbage\nmore garbage\n", fixture_text("nvidia/query_8x_a100.csv")])
def test_no_topology_no_label(host, text):
    host.tool(
        "nvidia-smi",
        rule("nvidia/query_8x_a100.csv", when=[QUERY]),
        rule("nvidia/q_8x_a100.txt", when=["-q"]),
        rule(text=text, when=["topo", "-m"]),
    )
    assert host.detector().detect().labels == {}


def test_a_failed_topology_read_is_retried_later_not_every_beat(host):
    host.tool(
        "nvidia-smi",
        rule("nvidia/query_8x_a100.csv", when=[QUERY]),
        rule("nvidia/q_8x_a100.txt", when=["-q"]),
        rule(text="", when=["topo", "-m"], code=1),
    )
    detector = host.detector(rescan_every=3)
    for _ in range(3):
        assert detector.detect().labels == {}
    assert len([c for c in host.calls("nvidia-smi") if c[0] == "topo"]) == 1
    host.tool(
        "nvidia-smi",
        rule("nvidia/query_8x_a100.csv", when=[QUERY]),
        rule("nvidia/q_8x_a100.txt", when=["-q"]),
        rule("nvidia/topo_4x_bridges.txt", when=["topo", "-m"]),
    )
    assert TOPOLOGY_LABEL in detector.detect().labels


def test_a_label_too_long_for_the_schema_keeps_the_same_domains():
    everything = {
        "nvlink": [[a, b] for a in range(64) for b in range(a + 1, 64)],
        "numa": {str(i): i // 32 for i in range(64)},
    }
    value = topology_label(everything)
    assert len(value) <= 4096
    pairs = json.loads(value)["nvlink"]
    assert len(pairs) == 63 and {x for pair in pairs for x in pair} == set(range(64))


def test_no_devices_is_not_an_nvidia_node(host):
    host.tool("nvidia-smi", rule("nvidia/no_devices.txt", code=6))
    result = host.detector().detect()
    assert result.virtual and result.vendor == "virtual"


# -- NVML -------------------------------------------------------------------------


class _NVMLError(Exception):
    pass


class _GpuIsLost(_NVMLError):
    pass


def _fake_pynvml(cards, lost=None, gone=None):
    """A stand-in for the pynvml module (no fake shared library needed). `lost` and
    `gone` are sets of UUIDs a test may change between beats."""
    lost = set() if lost is None else lost
    gone = set() if gone is None else gone
    m = types.ModuleType("pynvml")
    m.NVMLError = _NVMLError
    m.NVML_TEMPERATURE_GPU = 0
    m.NVML_DEVICE_MIG_ENABLE = 1
    m.nvmlInit = lambda: None
    visible = lambda: [c for c in cards if c["uuid"] not in gone]  # noqa: E731
    m.nvmlDeviceGetCount = lambda: len(visible())
    m.nvmlDeviceGetHandleByIndex = lambda i: visible()[i]

    def by_uuid(uuid):
        for card in cards:
            if card["uuid"] == uuid and uuid not in gone:
                return card
        raise _GpuIsLost("GPU is lost")

    m.nvmlDeviceGetHandleByUUID = by_uuid
    m.nvmlDeviceGetUUID = lambda h: h["uuid"].encode()
    m.nvmlDeviceGetName = lambda h: h["name"]

    def guarded(value):
        def call(h, *args):
            if h["uuid"] in lost:
                raise _GpuIsLost("GPU is lost")
            return value(h)

        return call

    m.nvmlDeviceGetMemoryInfo = guarded(lambda h: types.SimpleNamespace(total=h["total"] << 20, used=h["used"] << 20))
    m.nvmlDeviceGetUtilizationRates = guarded(lambda h: types.SimpleNamespace(gpu=h["util"], memory=0))
    m.nvmlDeviceGetTemperature = guarded(lambda h: h["temp"])
    m.nvmlDeviceGetPowerUsage = guarded(lambda h: h["mw"])
    m.nvmlDeviceGetCudaComputeCapability = guarded(lambda h: (9, 0))
    m.nvmlDeviceGetMigMode = guarded(lambda h: (h["mig"], h["mig"]))
    return m


NVML_CARDS = [
    {
        "uuid": f"GPU-nvml-{i}",
        "name": "NVIDIA H100 80GB HBM3",
        "total": 81559,
        "used": 100 * i,
        "util": 10 * i,
        "temp": 30 + i,
        "mw": 70000 + i,
        "mig": 1 if i == 0 else 0,
    }
    for i in range(3)
]


def test_nvml_when_it_loads(host, monkeypatch, validate):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(NVML_CARDS))
    result = host.detector(nvml=True).detect()
    assert (result.vendor, result.tool, result.collector_error) == ("nvidia", "nvml", "")
    assert result.gpus[2] == {
        "index": 2,
        "vendor": "nvidia",
        "uuid": "GPU-nvml-2",
        "model": "NVIDIA H100 80GB HBM3",
        "memory_total_mb": 81559,
        "utilization": 20,
        "memory_used_mb": 200,
        "temperature": 32,
        "power_w": 70.0,
        "compute_capability": "9.0",
        "metrics_available": ["utilization", "memory_used_mb", "temperature", "power_w"],
    }
    assert result.capabilities["0"]["mig_capable"] and not result.capabilities["1"]["mig_capable"]
    assert host.calls() == []  # no tool ran
    validate(result.heartbeat_fields())


def test_nvml_names_a_lost_card(host, monkeypatch):
    lost, gone = set(), set()
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(NVML_CARDS, lost, gone))
    detector = host.detector(nvml=True)
    assert len(detector.detect().gpus) == 3
    lost.add("GPU-nvml-1")
    gone.add("GPU-nvml-2")
    result = detector.detect()
    assert [g["index"] for g in result.gpus] == [0]
    assert [(f["index"], f["uuid"], "lost" in f["error"]) for f in result.collect_failures] == [
        (1, "GPU-nvml-1", True),
        (2, "GPU-nvml-2", True),
    ]


def test_nvml_that_does_not_load_leaves_nvidia_smi(host, monkeypatch):
    broken = types.ModuleType("pynvml")

    def fail():
        raise OSError("NVML Shared Library Not Found")

    broken.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    eight_cards(host)
    result = host.detector(nvml=True).detect()
    assert result.tool.endswith("/usr/bin/nvidia-smi") and len(result.gpus) == 8


def test_nvml_is_not_tried_against_a_scratch_root(host, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(NVML_CARDS))
    from heteroflow_agent.detect import Detector

    assert Detector(str(host.root)).detect().virtual


def test_rows_without_any_readable_uuid_are_a_collector_error_not_zero_cards(host):
    rows = (
        "0, [Unknown Error], [Unknown Error], [Unknown Error], [Unknown Error], "
        "[Unknown Error], [Unknown Error], [Unknown Error], [Unknown Error]\n"
    )
    host.tool("nvidia-smi", rule(text=rows, when=[QUERY], code=15))
    result = host.detector().detect()
    assert result.gpus == [] and result.collect_failures == []
    assert result.collector_error == "no card could be identified in the output of nvidia-smi"


def test_nvml_reads_the_same_health_fields(host, monkeypatch, validate):
    """The thin NVML health reads (ECC mode and totals, retired pages, remapped rows,
    throttle reasons, the PCI bus for Xid events); a call the card refuses is absent."""
    m = _fake_pynvml(NVML_CARDS)
    m.NVML_FEATURE_ENABLED = 1
    m.NVML_MEMORY_ERROR_TYPE_CORRECTED, m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    m.NVML_VOLATILE_ECC, m.NVML_AGGREGATE_ECC = 0, 1
    m.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    m.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    counts = {(0, 0): 5, (1, 0): 2, (0, 1): 40, (1, 1): 2}

    def refused(h, *args):
        raise _NVMLError("Not Supported")

    m.nvmlDeviceGetEccMode = lambda h: (1, 1)
    m.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: counts[(kind, counter)] if h["uuid"] != "GPU-nvml-0" else 0
    m.nvmlDeviceGetRetiredPages = refused  # Hopper retires no pages
    m.nvmlDeviceGetRetiredPagesPendingStatus = refused
    m.nvmlDeviceGetRemappedRows = lambda h: (1, 2, 1, 0) if h["uuid"] == "GPU-nvml-1" else (0, 0, 0, 0)
    m.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x04 | 0x08 | 0x40  # sw power cap, hw, hw thermal
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(
        busId=f"00000000:{0x18 + int(h['uuid'][-1]):02X}:00.0".encode()
    )
    monkeypatch.setitem(sys.modules, "pynvml", m)
    host.file("dev/kmsg", "4,1,9000000,-;NVRM: Xid (PCI:0000:19:00): 79, pid=1, name=x, GPU has fallen off the bus.\n")
    result = host.detector(nvml=True).detect()
    first, second, _third = result.health
    assert first["ecc_uncorrected_volatile"] == 0 and first["xid_events"] == []
    assert second["ecc_mode"] == "enabled"
    assert (second["ecc_corrected_volatile"], second["ecc_uncorrected_volatile"]) == (5, 2)
    assert (second["ecc_corrected_aggregate"], second["ecc_uncorrected_aggregate"]) == (40, 2)
    assert (second["remapped_rows_correctable"], second["remapped_rows_uncorrectable"]) == (1, 2)
    assert (second["remapped_rows_pending"], second["remapped_rows_failure"]) == (True, False)
    assert second["throttle_reasons"] == ["hw_slowdown", "hw_thermal_slowdown"]
    assert [e["code"] for e in second["xid_events"]] == [79]
    assert "retired_pages_single_bit" not in second and "retired_pages_pending" not in second
    assert host.calls() == []  # no tool ran
    validate(result.heartbeat_fields())
