"""Card health: ECC counters, retired and remapped pages, Xid events, hardware throttle
reasons, read from the vendor's tool where it documents them.

A reading is one dict per card, named as the heartbeat schema names them (`gpu_health`):
a field the tool could not read is absent (and not in `available`), never 0. Readers
here only parse; which vendor may report what is the capability matrix's `health` row,
and the detector drops anything the row does not list.

Sources (the recorded outputs in agent/tests/fixtures/*/README.md say where each came
from):
- NVIDIA: `nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE` (the "ECC
  Errors", "Retired Pages", "Remapped Rows" and "Clocks Event Reasons" / older "Clocks
  Throttle Reasons" sections of nvidia-smi(1)'s GPU ATTRIBUTES), both ECC layouts
  (SRAM/DRAM Correctable/Uncorrectable since the Hopper-era drivers; Single/Double Bit
  ... Total before); Xid events from the kernel log (NVIDIA's Xid catalog).
- AMD: `amd-smi metric --ecc --json` ("ecc": total_correctable_count /
  total_uncorrectable_count, counted since the driver loaded: the volatile pair).
- Ascend: `npu-smi info -t ecc -i N -c C` (HBM, or DDR on cards without HBM: single/
  double bit error counts, their aggregate totals, isolated pages).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone

from .parsing import extract_json, lookup, sectioned_records

log = logging.getLogger(__name__)

# The counters and flags of a reading: apps.nodes.health.COUNTERS + FLAGS, the
# gpu_health_samples columns (the agent never imports the server; a test pins the two).
COUNTERS = (
    "ecc_corrected_volatile",
    "ecc_uncorrected_volatile",
    "ecc_corrected_aggregate",
    "ecc_uncorrected_aggregate",
    "retired_pages_single_bit",
    "retired_pages_double_bit",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
)
FLAGS = ("retired_pages_pending", "remapped_rows_pending", "remapped_rows_failure")
ECC_COUNTERS = COUNTERS[:4]  # corrected/uncorrected, volatile/aggregate
ECC_MODE, XID_EVENTS, THROTTLE_REASONS = "ecc_mode", "xid_events", "throttle_reasons"
# In the order `available` is written in (the schema's health_field enum).
FIELDS = (ECC_MODE, *COUNTERS, *FLAGS, XID_EVENTS, THROTTLE_REASONS)
# Only the hardware and thermal reasons: sw_power_cap and idle flip with the load and
# would make every beat's reading differ.
THROTTLES = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
MAX_XID = 32
XID_TEXT_MAX = 500
COUNTER_MAX = 2**53 - 1  # the schema's bound: a JSON-safe integer

_MISSING = {"", "N/A", "NA", "-", "UNKNOWN", "NONE", "[N/A]", "[NOT SUPPORTED]", "NOT SUPPORTED"}


def count(value) -> int | None:
    """A non-negative counter, or None ("N/A", "[Not Supported]", garbage, negative)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value <= COUNTER_MAX else None
    text = str(value).strip()
    if text.upper() in _MISSING or not re.fullmatch(r"\d+", text):
        return None
    number = int(text)
    return number if number <= COUNTER_MAX else None


def flag(value) -> bool | None:
    text = str(value or "").strip().lower()
    if text in ("yes", "true", "1"):
        return True
    if text in ("no", "false", "0"):
        return False
    return None


def _total(*values: int | None) -> int | None:
    """The sum of the parts that could be read; None when none could."""
    read = [v for v in values if v is not None]
    return min(sum(read), COUNTER_MAX) if read else None


def finish(reading: dict, allowed: Iterable[str] | None = None) -> dict:
    """Keep only the health fields that were read (not None) and are allowed, in the
    schema's order, and write `available`; anything else a reader left is dropped."""
    allowed = set(FIELDS if allowed is None else allowed)
    out = {name: reading[name] for name in FIELDS if reading.get(name) is not None and name in allowed}
    out["available"] = list(out)
    return out


# -- NVIDIA: nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE ---------------

NVIDIA_SECTIONS = ("ECC", "PAGE_RETIREMENT", "ROW_REMAPPER", "PERFORMANCE")
_GPU_BLOCK = re.compile(r"^GPU\s+([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_BUS = re.compile(r"^(?:PCI:)?([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})(?:\.[0-7])?$")
_THROTTLE_KEYS = {
    "hw slowdown": "hw_slowdown",
    "hw thermal slowdown": "hw_thermal_slowdown",
    "hw power brake slowdown": "hw_power_brake_slowdown",
    "sw thermal slowdown": "sw_thermal_slowdown",
}


def bus_key(text: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of "00000000:65:00.0" (nvidia-smi) or "0000:65:00" (the
    kernel's Xid line), which name the same card in different widths."""
    match = _BUS.match((text or "").strip())
    if not match:
        return None
    return int(match[1], 16), int(match[2], 16), int(match[3], 16)


def _ecc(record: dict, kind: str) -> tuple[int | None, int | None]:
    """(corrected, uncorrected) of "volatile" or "aggregate", in either layout."""
    base = f"^ecc errors/{kind}/"
    old = (
        count(lookup(record, base + r"single bit/total$")),
        count(lookup(record, base + r"double bit/total$")),
    )
    if old != (None, None):
        return old
    parts = {path[len(f"ecc errors/{kind}/") :]: value for path, value in record.items() if re.match(base, path)}
    corrected = _total(*(count(v) for k, v in parts.items() if re.fullmatch(r"(sram|dram) correctable", k)))
    uncorrected = _total(
        *(count(v) for k, v in parts.items() if re.fullmatch(r"(sram|dram) uncorrectable( parity| sec-ded)?", k))
    )
    return corrected, uncorrected


def _throttles(record: dict) -> list[str] | None:
    states: dict[str, str] = {}
    for path, value in record.items():
        head, _, rest = path.partition("/")
        if head not in ("clocks event reasons", "clocks throttle reasons"):
            continue
        name = _THROTTLE_KEYS.get(rest.rsplit("/", 1)[-1])
        if name:
            states.setdefault(name, value.strip().lower())
    readable = {k: v for k, v in states.items() if v in ("active", "not active")}
    if not readable:
        return None
    return [name for name in THROTTLES if readable.get(name) == "active"]


def parse_nvidia_health(text: str) -> dict[tuple[int, int, int], dict]:
    """(domain, bus, device) -> the card's reading (without `available`)."""
    cards: dict[tuple[int, int, int], dict] = {}
    for opened, record in sectioned_records(text, _GPU_BLOCK):
        key = bus_key(opened.group(1))
        if key is None or key in cards:
            continue
        mode = (lookup(record, r"^ecc mode/current$") or "").strip().lower()
        volatile = _ecc(record, "volatile")
        aggregate = _ecc(record, "aggregate")
        reading = {
            ECC_MODE: mode if mode in ("enabled", "disabled") else None,
            "ecc_corrected_volatile": volatile[0],
            "ecc_uncorrected_volatile": volatile[1],
            "ecc_corrected_aggregate": aggregate[0],
            "ecc_uncorrected_aggregate": aggregate[1],
            "retired_pages_single_bit": count(lookup(record, r"^retired pages/single bit ecc$")),
            "retired_pages_double_bit": count(lookup(record, r"^retired pages/double bit ecc$")),
            "retired_pages_pending": flag(lookup(record, r"^retired pages/pending( page blacklist)?$")),
            "remapped_rows_correctable": count(lookup(record, r"^remapped rows/correctable error$")),
            "remapped_rows_uncorrectable": count(lookup(record, r"^remapped rows/uncorrectable error$")),
            "remapped_rows_pending": flag(lookup(record, r"^remapped rows/pending$")),
            "remapped_rows_failure": flag(lookup(record, r"^remapped rows/remapping failure occurred$")),
            THROTTLE_REASONS: _throttles(record),
        }
        if any(v is not None for v in reading.values()):
            cards[key] = reading
    return cards


def parse_bus_ids(text: str) -> dict[tuple[int, int, int], str]:
    """(domain, bus, device) -> UUID from `--query-gpu=index,uuid,pci.bus_id`."""
    found: dict[tuple[int, int, int], str] = {}
    for line in (text or "").splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 3 or not cells[0].isdigit() or not cells[1].startswith(("GPU-", "MIG-")):
            continue
        key = bus_key(cells[2])
        if key is not None:
            found.setdefault(key, cells[1])
    return found


# -- Xid events from the kernel log ------------------------------------------------------

_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?\): (\d+),?\s*(.*)$"
)
_NOISE = re.compile(r"^(?:pid=[^,]*,\s*|name=[^,]*,\s*)+")
_KMSG = re.compile(r"^\d+,\d+,(\d+),[^;]*;(.*)$")  # prio,seq,usec,flags;message
_DMESG = re.compile(r"^\[\s*(\d+(?:\.\d+)?)\]\s(.*)$")


def parse_xid(message: str) -> tuple[tuple[int, int, int], int, str] | None:
    """(bus, code, text) of one "NVRM: Xid (PCI:0000:65:00): 79, pid=..., text" line."""
    match = _XID.search(message or "")
    if not match:
        return None
    key = bus_key(match[1])
    code = int(match[2])
    if key is None or code > 65535:
        return None
    text = _NOISE.sub("", match[3].strip()).strip().rstrip(".").strip()
    return key, code, text[:XID_TEXT_MAX]


def _boot_epoch() -> float:
    clock = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
    return time.time() - time.clock_gettime(clock)


class KernelLog:
    """The NVIDIA Xid lines of the kernel log, kept per card (bus) as they arrive.

    /dev/kmsg is opened once, non-blocking, and drained on each read (each read(2)
    returns one record; EAGAIN means nothing more, EPIPE that records were overwritten
    before we read them). Where it cannot be opened, `dmesg` is run and only lines past
    the last one seen are taken. Neither readable: `readable` is False, and the caller
    leaves `xid_events` out. Event times are the boot time (taken once, so they do not
    move between reads) plus the record's time since boot, to the second.
    """

    MAX_RECORDS = 20000  # per read: a flood of kernel messages must not hold the beat

    def __init__(self, root: str = "/", run: Callable | None = None, *, boot_epoch: float | None = None):
        self.root = root or "/"
        self.run = run
        self.boot = _boot_epoch() if boot_epoch is None else boot_epoch
        self.events: dict[tuple[int, int, int], list[dict]] = {}
        self.readable = False
        self._fd: int | None = None
        self._last = -1.0  # the time since boot of the last record taken
        self._dmesg_refused = 0  # reads to skip dmesg after it was refused

    def read(self) -> bool:
        """Take the new Xid lines; whether the log could be read this time."""
        records = self._kmsg()
        if records is None:
            records = self._dmesg()
        self.readable = records is not None
        for seconds, message in records or ():
            if seconds <= self._last:
                continue
            self._last = seconds
            parsed = parse_xid(message)
            if parsed is None:
                continue
            key, code, text = parsed
            at = datetime.fromtimestamp(int(self.boot + seconds), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            events = self.events.setdefault(key, [])
            events.append({"code": code, "at": at, "text": text})
            del events[:-MAX_XID]
        return self.readable

    def for_card(self, key: tuple[int, int, int] | None) -> list[dict]:
        return [dict(e) for e in self.events.get(key, ())] if key is not None else []

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _kmsg(self) -> list[tuple[float, str]] | None:
        if self._fd is None:
            try:
                self._fd = os.open(os.path.join(self.root, "dev/kmsg"), os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                return None
        records: list[tuple[float, str]] = []
        pending = b""
        for _ in range(self.MAX_RECORDS):
            try:
                chunk = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten before we read them: go on
                    continue
                self.close()
                return None
            if not chunk:  # a regular file (tests) at its end
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                match = _KMSG.match(line.decode("utf-8", "replace"))
                if match:
                    records.append((int(match[1]) / 1e6, match[2]))
        return records

    def _dmesg(self) -> list[tuple[float, str]] | None:
        from .command import find_command

        if self.run is None:
            return None
        if self._dmesg_refused:
            self._dmesg_refused -= 1
            return None
        path = find_command("dmesg", self.root)
        if not path:
            return None
        result = self.run([path])
        if not result.ok:
            self._dmesg_refused = 10  # not permitted (dmesg_restrict): ask again later
            return None
        records = []
        for line in result.stdout.splitlines():
            match = _DMESG.match(line)
            if match:
                records.append((float(match[1]), match[2]))
        return records


# -- AMD: amd-smi metric --ecc --json ------------------------------------------------------

AMD_SMI_ECC = ("metric", "--ecc", "--json")


def parse_amd_ecc(text: str) -> dict[int, dict]:
    data = extract_json(text)
    if isinstance(data, dict) and isinstance(data.get("gpu_data"), list):
        data = data["gpu_data"]
    cards: dict[int, dict] = {}
    for entry in data if isinstance(data, list) else ():
        if not isinstance(entry, dict):
            continue
        index, ecc = entry.get("gpu"), entry.get("ecc")
        if not isinstance(index, int) or isinstance(index, bool) or not isinstance(ecc, dict):
            continue
        reading = {
            "ecc_corrected_volatile": count(ecc.get("total_correctable_count")),
            "ecc_uncorrected_volatile": count(ecc.get("total_uncorrectable_count")),
        }
        if any(v is not None for v in reading.values()):
            cards.setdefault(index, reading)
    return cards


# -- Ascend: npu-smi info -t ecc -i N -c C -------------------------------------------------


def parse_npu_ecc(text: str) -> dict | None:
    """One chip's reading: the HBM counters, or the DDR ones on a card without HBM."""
    values: dict[str, str] = {}
    for line in (text or "").splitlines():
        name, sep, value = line.partition(":")
        if sep:
            values.setdefault(name.strip().lower(), value.strip())
    for memory in ("hbm", "ddr"):
        reading = {
            "ecc_corrected_volatile": count(values.get(f"{memory} single bit error count")),
            "ecc_uncorrected_volatile": count(values.get(f"{memory} double bit error count")),
            "ecc_corrected_aggregate": count(values.get(f"{memory} single bit aggregate total err cnt")),
            "ecc_uncorrected_aggregate": count(values.get(f"{memory} double bit aggregate total err cnt")),
            "retired_pages_single_bit": count(values.get(f"{memory} single bit isolated pages count")),
            "retired_pages_double_bit": count(values.get(f"{memory} double bit isolated pages count")),
        }
        if any(v is not None for v in reading.values()):
            return reading
    return None


class HealthError(RuntimeError):
    """The health tool failed as a whole (hung, refused, printed nothing usable)."""
