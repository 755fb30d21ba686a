"""Card health: the recorded `nvidia-smi -q -d ECC,...` outputs in both ECC layouts, the
Xid lines of the kernel log, amd-smi's and npu-smi's ECC reports, and the detector's
30 s cadence (cached between reads, the last good reading kept when a read fails)."""

from __future__ import annotations

import pytest

from heteroflow_agent.detect import health as hl
from heteroflow_agent.detect.matrix import MATRIX

from .conftest import fixture_text, rule

H100 = [line.split(", ")[1] for line in fixture_text("nvidia/query_2x_h100.csv").splitlines()]
BUS_QUERY = "--query-gpu=index,uuid,pci.bus_id"
QUERY = "--query-gpu="
H100_BUS = (0, 0x18, 0), (0, 0x2A, 0)


def h100s(host, *first, health="nvidia/q_health_2x_h100.txt", **kwargs):
    host.tool(
        "nvidia-smi",
        *first,
        rule(health, when=["-q", "-d"], **kwargs),
        rule("nvidia/query_bus_ids_2x_h100.csv", when=[BUS_QUERY]),
        rule("nvidia/query_2x_h100.csv", when=[QUERY]),
        rule(text="", when=["-q"]),
        rule("nvidia/topo_2x_pcie.txt", when=["topo"]),
    )


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


# -- the nvidia-smi parser ---------------------------------------------------------------


def test_the_newer_layout_sums_sram_and_dram_and_reads_rows_and_throttles():
    cards = hl.parse_nvidia_health(fixture_text("nvidia/q_health_2x_h100.txt"))
    assert list(cards) == list(H100_BUS)
    healthy, sick = (hl.finish(cards[bus]) for bus in H100_BUS)
    assert healthy == {
        "ecc_mode": "enabled",
        "ecc_corrected_volatile": 0,
        "ecc_uncorrected_volatile": 0,
        "ecc_corrected_aggregate": 12,
        "ecc_uncorrected_aggregate": 0,
        "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": False,
        "remapped_rows_failure": False,
        "throttle_reasons": [],  # SW Power Cap is active, and is never reported
        "available": [
            "ecc_mode",
            "ecc_corrected_volatile",
            "ecc_uncorrected_volatile",
            "ecc_corrected_aggregate",
            "ecc_uncorrected_aggregate",
            "remapped_rows_correctable",
            "remapped_rows_uncorrectable",
            "remapped_rows_pending",
            "remapped_rows_failure",
            "throttle_reasons",
        ],
    }
    # Hopper retires no pages (it remaps rows): N/A there is absent, not 0
    assert "retired_pages_single_bit" not in healthy and "retired_pages_pending" not in healthy
    assert (sick["ecc_corrected_volatile"], sick["ecc_uncorrected_volatile"]) == (8, 2)
    assert (sick["ecc_corrected_aggregate"], sick["ecc_uncorrected_aggregate"]) == (44, 2)
    assert (sick["remapped_rows_correctable"], sick["remapped_rows_uncorrectable"]) == (1, 2)
    assert sick["remapped_rows_pending"] is True and sick["remapped_rows_failure"] is False
    assert sick["throttle_reasons"] == ["hw_slowdown", "hw_thermal_slowdown"]


def test_the_older_layout_reads_the_single_and_double_bit_totals_and_retired_pages():
    cards = hl.parse_nvidia_health(fixture_text("nvidia/q_health_2x_v100_old.txt"))
    first, second = (hl.finish(cards[bus]) for bus in ((0, 0x41, 0), (0, 0x61, 0)))
    assert first["ecc_mode"] == "enabled"  # "Ecc Mode" in these drivers
    assert (first["ecc_corrected_volatile"], first["ecc_uncorrected_volatile"]) == (0, 0)
    assert (first["ecc_corrected_aggregate"], first["ecc_uncorrected_aggregate"]) == (3, 0)
    assert (first["retired_pages_single_bit"], first["retired_pages_double_bit"]) == (1, 0)
    assert first["retired_pages_pending"] is False
    assert (second["ecc_uncorrected_volatile"], second["ecc_uncorrected_aggregate"]) == (1, 1)
    assert (second["retired_pages_double_bit"], second["retired_pages_pending"]) == (1, True)
    assert second["throttle_reasons"] == ["sw_thermal_slowdown"]  # "Clocks Throttle Reasons"
    # no row remapper on Volta ("Remapped Rows : N/A"): absent
    assert not any(name.startswith("remapped_rows") for name in first)


def test_a_card_without_ecc_reports_only_what_it_has():
    [card] = hl.parse_nvidia_health(fixture_text("nvidia/q_health_1x_rtx4060_ecc_na.txt")).values()
    assert hl.finish(card) == {"throttle_reasons": [], "available": ["throttle_reasons"]}


def test_output_cut_short_keeps_what_was_read_and_no_more():
    cards = hl.parse_nvidia_health(fixture_text("nvidia/q_health_truncated.txt"))
    assert hl.finish(cards[H100_BUS[0]])["ecc_corrected_aggregate"] == 12
    cut = hl.finish(cards[H100_BUS[1]])
    assert cut["available"] == ["ecc_mode", "ecc_corrected_volatile", "ecc_uncorrected_volatile"]


@pytest.mark.parametrize("name", ["nvidia/garbage.txt", "nvidia/empty.txt", "nvidia/driver_failed.txt"])
def test_garbage_is_no_reading(name):
    assert hl.parse_nvidia_health(fixture_text(name)) == {}


def test_counters_refuse_what_is_not_a_count():
    assert [hl.count(v) for v in ("7", " 0 ", "N/A", "[Not Supported]", "-1", "3.5", "", None, True, 2**60)] == [
        7,
        0,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    ]
    assert [hl.flag(v) for v in ("Yes", "No", "N/A", None)] == [True, False, None, None]


def test_bus_ids_name_the_same_card_in_both_widths():
    assert hl.bus_key("00000000:2A:00.0") == hl.bus_key("0000:2a:00") == hl.bus_key("PCI:0000:2a:00") == (0, 42, 0)
    assert hl.bus_key("garbage") is None
    assert hl.parse_bus_ids(fixture_text("nvidia/query_bus_ids_2x_h100.csv")) == dict(zip(H100_BUS, H100, strict=True))
    # the metrics query's rows (nine cells) are not bus rows
    assert hl.parse_bus_ids(fixture_text("nvidia/query_2x_h100.csv")) == {}


# -- Xid events ------------------------------------------------------------------------------


def test_xid_lines_in_their_several_shapes():
    assert hl.parse_xid("NVRM: Xid (PCI:0000:65:00): 79, pid=1234, name=python, GPU has fallen off the bus.") == (
        (0, 0x65, 0),
        79,
        "GPU has fallen off the bus",
    )
    assert hl.parse_xid("NVRM: Xid (0000:03:00): 13, 0003 00000000 0000c197")[1:] == (13, "0003 00000000 0000c197")
    long = hl.parse_xid("NVRM: Xid (PCI:0000:65:00): 31, " + "x" * 900)
    assert len(long[2]) == hl.XID_TEXT_MAX
    assert hl.parse_xid("NVRM: GPU at PCI:0000:65:00: GPU-1") is None
    assert hl.parse_xid("NVRM: Xid (PCI:0000:65:00): 99999, too big") is None


def test_the_kernel_log_is_read_once_and_then_only_what_is_new(host):
    kmsg = host.file("dev/kmsg", fixture_text("nvidia/kmsg_xid.txt"))
    log = hl.KernelLog(str(host.root), boot_epoch=1_800_000_000)
    assert log.read() is True
    sick = log.for_card(H100_BUS[1])
    assert [(e["code"], e["at"]) for e in sick] == [(48, "2027-01-15T10:00:00Z"), (63, "2027-01-15T10:00:00Z")]
    assert sick[0]["text"].startswith("An uncorrectable double bit error (DBE)")
    assert [e["code"] for e in log.for_card(H100_BUS[0])] == [13]
    assert log.for_card((0, 0x99, 0)) == [] and log.for_card(None) == []
    with kmsg.open("a") as fh:  # more records arrive: only they are taken
        fh.write("4,1006,7500000000,-;NVRM: Xid (PCI:0000:18:00): 79, pid=9, name=x, GPU has fallen off the bus.\n")
    log.read()
    assert [e["code"] for e in log.for_card(H100_BUS[0])] == [13, 79]
    assert [e["code"] for e in log.for_card(H100_BUS[1])] == [48, 63]
    log.close()


def test_only_the_last_32_events_of_a_card_are_kept(host):
    lines = [f"4,{i},{(i + 1) * 1_000_000},-;NVRM: Xid (PCI:0000:18:00): {i}, event {i}\n" for i in range(40)]
    host.file("dev/kmsg", "".join(lines))
    log = hl.KernelLog(str(host.root), boot_epoch=0)
    log.read()
    assert [e["code"] for e in log.for_card(H100_BUS[0])] == list(range(8, 40))


def test_dmesg_when_kmsg_cannot_be_opened(host, run):
    host.tool("dmesg", rule("nvidia/dmesg_xid.txt"))
    log = hl.KernelLog(str(host.root), run, boot_epoch=1_800_000_000)
    assert log.read() is True
    assert [(e["code"], e["text"]) for e in log.for_card(H100_BUS[1])] == [(79, "GPU has fallen off the bus")]
    assert [(e["code"], e["at"]) for e in log.for_card(H100_BUS[0])] == [(31, "2027-01-15T10:01:40Z")]
    log.read()  # the same buffer again: nothing doubled
    assert len(log.for_card(H100_BUS[1])) == 1


def test_an_unreadable_log_says_so(host, run):
    host.tool("dmesg", rule(text="", err="dmesg: read kernel buffer failed: Operation not permitted\n", code=1))
    log = hl.KernelLog(str(host.root), run)
    assert log.read() is False
    assert hl.KernelLog(str(host.root), None).read() is False  # no kmsg, no way to run dmesg


@pytest.fixture
def run():
    from heteroflow_agent.detect.command import run_tool

    return lambda argv: run_tool(argv, 5.0)


# -- the detector: shape, cadence, failures -----------------------------------------------------


def test_nvidia_health_lands_on_the_cards_by_uuid_with_their_xid_events(host, validate):
    host.file("dev/kmsg", fixture_text("nvidia/kmsg_xid.txt"))
    h100s(host)
    result = host.detector().detect()
    healthy, sick = result.health
    assert (healthy["index"], sick["index"]) == (0, 1)
    assert sick["ecc_uncorrected_volatile"] == 2 and "xid_events" in sick["available"]
    assert [e["code"] for e in sick["xid_events"]] == [48, 63]
    assert [e["code"] for e in healthy["xid_events"]] == [13]
    fields = result.heartbeat_fields()
    assert fields["gpu_health"] == result.health
    validate(fields)


def test_without_a_readable_kernel_log_xid_events_are_absent(host, validate):
    h100s(host)
    health = host.detector().detect().health
    assert all("xid_events" not in card and "xid_events" not in card["available"] for card in health)
    assert health[1]["ecc_uncorrected_aggregate"] == 2


def test_health_is_read_every_30_seconds_and_cached_between(host):
    clock = Clock()
    detector = host.detector(clock=clock)
    h100s(host)
    first = detector.detect().health
    clock.now += 5
    assert detector.detect().health == first
    clock.now += 10
    detector.detect()
    assert len([c for c in host.calls("nvidia-smi") if "-d" in c]) == 1
    clock.now += 15
    detector.detect()
    assert len([c for c in host.calls("nvidia-smi") if "-d" in c]) == 2
    assert ["-q", "-d", "ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE"] in host.calls("nvidia-smi")


def test_the_interval_is_configurable(host):
    clock = Clock()
    detector = host.detector(clock=clock, health_every=120)
    h100s(host)
    for _ in range(5):  # at 0, 31, 62, 93 and 124 s: read at 0 and 124
        detector.detect()
        clock.now += 31
    assert len([c for c in host.calls("nvidia-smi") if "-d" in c]) == 2


def test_a_failing_read_keeps_the_last_good_reading_and_never_the_beat(host, caplog, validate):
    clock = Clock()
    detector = host.detector(clock=clock)
    h100s(host)
    good = detector.detect().health
    assert good
    h100s(host, health="nvidia/empty.txt", code=255, err="Unable to determine the device handle: Unknown Error\n")
    clock.now += 30
    result = detector.detect()
    assert result.collector_error == "" and len(result.gpus) == 2  # the beat is whole
    assert result.health == good
    assert "gpu health read failed" in caplog.text
    validate(result.heartbeat_fields())


def test_a_hung_health_read_is_a_failed_read(host):
    clock = Clock()
    detector = host.detector(clock=clock, timeout=1.0)
    h100s(host, health="nvidia/q_health_2x_h100.txt", sleep=3)
    result = detector.detect()
    assert result.health is None and len(result.gpus) == 2


def test_a_driver_without_row_remapping_is_asked_without_it(host):
    host.tool(
        "nvidia-smi",
        rule(text="", when=["-d", "ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE"], code=2, err="Invalid -d argument\n"),
        rule("nvidia/q_health_2x_v100_old.txt", when=["-q", "-d"]),
        rule("nvidia/query_bus_ids_2x_v100.csv", when=[BUS_QUERY]),
        rule(
            text="0, GPU-11111111-2222-3333-4444-555555555555, Tesla V100-SXM2-32GB, 32768, 0, 0, 30, 40.1, 7.0\n"
            "1, GPU-66666666-7777-8888-9999-000000000000, Tesla V100-SXM2-32GB, 32768, 0, 0, 31, 41.2, 7.0\n",
            when=[QUERY],
        ),
        rule(text="", when=["-q"]),
        rule(text="", when=["topo"]),
    )
    health = host.detector().detect().health
    assert [card["retired_pages_double_bit"] for card in health] == [0, 1]
    asked = [c[2] for c in host.calls("nvidia-smi") if "-d" in c]
    assert asked == ["ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE", "ECC,PAGE_RETIREMENT,PERFORMANCE"]


def test_a_vendor_without_documented_health_sends_none(host):
    host.tool("mx-smi", rule("metax/" + _first_fixture("metax")))
    result = host.detector().detect()
    assert result.vendor == "metax" and result.health is None
    assert "gpu_health" not in result.heartbeat_fields()
    assert not MATRIX["metax"].health


def _first_fixture(vendor: str) -> str:
    from .conftest import FIXTURES

    return sorted(p.name for p in (FIXTURES / vendor).iterdir() if "1x" in p.name or "8x" in p.name)[0]


# -- other vendors -------------------------------------------------------------------------------


def test_amd_smi_ecc_totals_are_the_volatile_pair():
    cards = hl.parse_amd_ecc(fixture_text("amd/amd-smi_metric_ecc_4x_mi300x.json"))
    assert cards[1] == {"ecc_corrected_volatile": 12, "ecc_uncorrected_volatile": 0}
    assert cards[2] == {"ecc_corrected_volatile": 3, "ecc_uncorrected_volatile": 2}
    assert 3 not in cards  # all N/A: no reading
    assert hl.parse_amd_ecc(fixture_text("amd/garbage.json")) == {}
    assert hl.parse_amd_ecc(fixture_text("amd/empty.txt")) == {}


def test_amd_health_through_the_detector(host, validate):
    host.tool(
        "amd-smi",
        rule("amd/amd-smi_static_8x_mi300x.json", when=["static"]),
        rule("amd/amd-smi_metric_ecc_4x_mi300x.json", when=["metric", "--ecc"]),
        rule("amd/amd-smi_metric_8x_mi300x.json", when=["metric"]),
    )
    result = host.detector().detect()
    by_index = {card["index"]: card for card in result.health}
    assert sorted(by_index) == [0, 1, 2]
    assert by_index[2]["available"] == ["ecc_corrected_volatile", "ecc_uncorrected_volatile"]
    validate(result.heartbeat_fields())


def test_rocm_smi_alone_reports_no_health(host):
    host.tool("rocm-smi", rule("amd/rocm-smi_2x_mi210.json"))
    result = host.detector().detect()
    assert result.vendor == "amd" and result.health is None


def test_npu_smi_ecc_per_chip(host, validate):
    host.tool(
        "npu-smi",
        rule("ascend/ecc_910b3_dbe.txt", when=["ecc", "-i", "1"]),
        rule("ascend/ecc_910b3.txt", when=["ecc"]),
        rule("ascend/info_8x_910b3.txt", when=["info"]),
    )
    result = host.detector().detect()
    assert len(result.health) == len(result.gpus)
    sick = next(card for card in result.health if card["ecc_uncorrected_volatile"])
    assert sick == {
        "index": sick["index"],
        "ecc_corrected_volatile": 2,
        "ecc_uncorrected_volatile": 1,
        "ecc_corrected_aggregate": 9,
        "ecc_uncorrected_aggregate": 1,
        "retired_pages_single_bit": 0,
        "retired_pages_double_bit": 1,
        "available": [
            "ecc_corrected_volatile",
            "ecc_uncorrected_volatile",
            "ecc_corrected_aggregate",
            "ecc_uncorrected_aggregate",
            "retired_pages_single_bit",
            "retired_pages_double_bit",
        ],
    }
    assert ["info", "-t", "ecc", "-i", "1", "-c", "0"] in host.calls("npu-smi")
    validate(result.heartbeat_fields())


def test_npu_smi_ecc_parser_edges():
    assert hl.parse_npu_ecc(fixture_text("ascend/ecc_310p_ddr.txt"))["ecc_corrected_volatile"] == 3
    assert hl.parse_npu_ecc(fixture_text("ascend/ecc_not_supported.txt")) is None
    assert hl.parse_npu_ecc(fixture_text("ascend/garbage.txt")) is None
    assert hl.parse_npu_ecc(fixture_text("ascend/dcmi_failed.txt")) is None


def test_npu_smi_failing_for_every_chip_is_a_failed_read(host):
    host.tool(
        "npu-smi",
        rule("ascend/dcmi_failed.txt", when=["ecc"], code=255),
        rule("ascend/info_1x_910b4.txt", when=["info"]),
    )
    result = host.detector().detect()
    assert result.health is None and len(result.gpus) == 1


# -- the matrix -----------------------------------------------------------------------------------


def test_the_health_matrix_lists_only_known_fields_and_only_the_documented_vendors():
    for vendor, row in MATRIX.items():
        assert row.health <= set(hl.FIELDS), vendor
    assert {vendor for vendor, row in MATRIX.items() if row.health} == {"nvidia", "amd", "ascend"}
    assert MATRIX["nvidia"].health == set(hl.FIELDS)


# -- the stateful stand-in (agent/tests/fixtures/slicing/nvidia_smi.py) ----------------------


def test_the_stateful_stand_in_raises_errors_on_a_running_detector(tmp_path, monkeypatch, validate):
    from agent.tests.slicing_host import Cards

    from heteroflow_agent.detect import Detector

    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    cards = Cards(tmp_path)
    cards.nvidia(count=2, mig=False)
    clock = Clock()
    detector = Detector(str(cards.root), timeout=5.0, nvml=False, is_container=False, clock=clock)
    before = detector.detect().health
    assert [(c["index"], c["ecc_uncorrected_volatile"], c["remapped_rows_failure"]) for c in before] == [
        (0, 0, False),
        (1, 0, False),
    ]
    cards.health(1, ecc_uncorrected_volatile=3, ecc_uncorrected_aggregate=3, throttle_reasons=["hw_slowdown"])
    clock.now += 30
    result = detector.detect()
    sick = result.health[1]
    assert (sick["ecc_uncorrected_volatile"], sick["ecc_uncorrected_aggregate"]) == (3, 3)
    assert sick["throttle_reasons"] == ["hw_slowdown"] and result.health[0] == before[0]
    validate(result.heartbeat_fields())


def test_finish_keeps_only_allowed_fields_that_were_read():
    reading = {"ecc_corrected_volatile": 1, "ecc_uncorrected_volatile": None, "_bus": (0, 1, 0), "xid_events": []}
    assert hl.finish(reading, {"ecc_corrected_volatile"}) == {
        "ecc_corrected_volatile": 1,
        "available": ["ecc_corrected_volatile"],
    }
    assert hl.finish(reading)["available"] == ["ecc_corrected_volatile", "xid_events"]
