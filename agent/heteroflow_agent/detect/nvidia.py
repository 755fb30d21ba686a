"""NVIDIA: NVML when the library loads, nvidia-smi otherwise (and always for topology).

nvidia-smi is the tested path: one CSV query per beat for the metrics, `nvidia-smi -q`
for the MIG mode (only when slicing is reported, so not in containers), `nvidia-smi
topo -m` once for NVLink and NUMA. NVML is kept thin on purpose: it saves the process
start-ups on real GPU servers, but nothing here can exercise it against a real
library, so it does the same few reads and leaves every decision to the detector.

NVIDIA is the one vendor with full per-card failure attribution: cards are keyed by
UUID, and a known card missing from the query is asked about on its own (`-i UUID`) so
its own error is reported against it.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Sequence

from . import health as hl
from .base import Runner, VendorTool, reading_from
from .mig import ListingError, list_instances
from .model import Card, Reading
from .parsing import CARD_ERROR, integer, lookup, number, sectioned_records, strip_ansi, to_mib

NVML = "nvml"  # the "path" of the NVML source
QUERY_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "temperature.gpu",
    "power.draw",
    "compute_cap",
)
TOPOLOGY_LABEL = "heteroflow.io/gpu-topology"
LABEL_MAX = 4096
_CC = re.compile(r"^\d+\.\d+$")


def _missing(cell: str) -> bool:
    cell = cell.strip()
    return not cell or cell.startswith("[") or cell.upper() in ("N/A", "NA", "-")


def query_argv(path: str, fields: Sequence[str], *extra: str) -> list[str]:
    return [path, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits", *extra]


def parse_query_csv(text: str, fields: Sequence[str]) -> list[Card]:
    """Rows of `--query-gpu=... --format=csv,noheader,nounits` (nvidia-smi and ixsmi).

    A row whose cell count does not match the query is not a card row (an error line,
    garbage) and is skipped.
    """
    cards: list[Card] = []
    for cells in csv.reader((text or "").splitlines(), skipinitialspace=True):
        cells = [c.strip() for c in cells]
        if len(cells) != len(fields):
            continue
        row = dict(zip(fields, cells, strict=True))
        index = integer(row.get("index"))
        if index is None or not row["index"].strip().isdigit():
            continue
        uuid = row.get("uuid", "")
        uuid = "" if _missing(uuid) else uuid
        card = Card(key=uuid or f"#{index}", index=index, uuid=uuid)
        name = row.get("name", "")
        card.model = "" if _missing(name) else name
        card.memory_total_mb = to_mib(row.get("memory.total"), "MiB")
        card.memory_used_mb = to_mib(row.get("memory.used"), "MiB")
        card.utilization = number(row.get("utilization.gpu"))
        card.temperature = number(row.get("temperature.gpu"))
        card.power_w = number(row.get("power.draw"))
        cc = row.get("compute_cap", "")
        card.compute_capability = cc if _CC.match(cc) else ""
        errors = [c for c in cells if CARD_ERROR.search(c)]
        if errors:
            card.error = errors[0]
        cards.append(card)
    return cards


_GPU_BLOCK = re.compile(r"^GPU\s+[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]\s*$")


def parse_mig_modes(text: str) -> dict[str, bool]:
    """UUID -> whether `nvidia-smi -q` says MIG mode is currently Enabled.

    Only "Enabled" counts: "Disabled", "N/A" (a card without MIG) and a pending change
    are all false, because a slice must not be offered on the strength of a mode the
    card is not in yet.
    """
    modes: dict[str, bool] = {}
    for _, record in sectioned_records(text, _GPU_BLOCK):
        uuid = lookup(record, r"^gpu uuid$")
        if not uuid:
            continue
        current = lookup(record, r"^mig mode/current$") or ""
        modes[uuid.strip()] = current.strip().lower() == "enabled"
    return modes


def parse_topology(text: str) -> dict | None:
    """`nvidia-smi topo -m` as {"nvlink": [[a, b], ...], "numa": {"a": node}}, or None.

    Cells are read by whitespace rather than by tab position: the matrix cells are
    single tokens, and nvidia-smi's tabs do not line up the trailing columns the same
    way across versions (empty cells, doubled tabs, underline escapes in the header).
    """
    devices: list[str] | None = None
    has_numa = False
    pairs = set()
    numa: dict[str, int] = {}
    gpus = set()
    for raw in strip_ansi(text).splitlines():
        tokens = raw.split()
        if not tokens:
            continue
        if devices is None:
            # the header names the columns; only it says "Affinity"
            if "GPU0" not in tokens or "Affinity" not in tokens:
                continue
            devices = []
            for token in tokens:
                if token == "CPU":
                    break
                devices.append(token)
            has_numa = "NUMA Affinity" in " ".join(tokens)
            continue
        if tokens[0].startswith("Legend"):
            break
        label = re.fullmatch(r"GPU(\d+)", tokens[0])
        if not label:
            continue
        row = int(label.group(1))
        gpus.add(row)
        cells = tokens[1:]
        for device, cell in zip(devices, cells, strict=False):
            col = re.fullmatch(r"GPU(\d+)", device)
            if col and re.fullmatch(r"NV\d+", cell) and int(col.group(1)) != row:
                a, b = sorted((row, int(col.group(1))))
                pairs.add((a, b))
        if has_numa and len(cells) > len(devices) + 1:
            node = cells[len(devices) + 1]
            if node.isdigit():
                numa[str(row)] = int(node)
    if not gpus:
        return None
    return {"nvlink": [list(p) for p in sorted(pairs)], "numa": numa}


def _spanning(pairs: list[list[int]]) -> list[list[int]]:
    """Fewer pairs joining the same cards: the server only unions them into domains."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    kept = []
    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
            kept.append([a, b])
    return kept


def topology_label(topology: dict) -> str:
    """Compact JSON for the label; past the schema's 4096 characters (a big NVSwitch
    mesh) the pairs are cut to a spanning set, which yields the same domains."""
    value = json.dumps(topology, separators=(",", ":"))
    if len(value) > LABEL_MAX:
        value = json.dumps({"nvlink": _spanning(topology["nvlink"]), "numa": topology["numa"]}, separators=(",", ":"))
    return value if len(value) <= LABEL_MAX else ""


class _Nvml:
    """The thin NVML reader: the same reads as the CSV query, nothing more."""

    def __init__(self, module):
        self.m = module

    @classmethod
    def load(cls):
        try:
            import pynvml  # from nvidia-ml-py; loads libnvidia-ml only on nvmlInit
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except Exception:  # no library, no driver: nvidia-smi decides
            return None
        return cls(pynvml)

    def _card(self, handle, index: int) -> Card:
        m = self.m
        uuid = _text(m.nvmlDeviceGetUUID(handle))
        card = Card(key=uuid, index=index, uuid=uuid)
        lost = []

        def get(call):
            try:
                return call()
            except Exception as exc:
                if "lost" in str(exc).lower() or type(exc).__name__.endswith("GpuIsLost"):
                    lost.append(str(exc) or "GPU is lost")
                return None

        card.model = _text(get(lambda: m.nvmlDeviceGetName(handle)) or "")
        memory = get(lambda: m.nvmlDeviceGetMemoryInfo(handle))
        if memory is not None:
            card.memory_total_mb = int(memory.total) // (1024 * 1024)
            card.memory_used_mb = int(memory.used) // (1024 * 1024)
        rates = get(lambda: m.nvmlDeviceGetUtilizationRates(handle))
        card.utilization = float(rates.gpu) if rates is not None else None
        temp = get(lambda: m.nvmlDeviceGetTemperature(handle, m.NVML_TEMPERATURE_GPU))
        card.temperature = float(temp) if temp is not None else None
        milliwatts = get(lambda: m.nvmlDeviceGetPowerUsage(handle))
        card.power_w = milliwatts / 1000.0 if milliwatts is not None else None
        cc = get(lambda: m.nvmlDeviceGetCudaComputeCapability(handle))
        card.compute_capability = f"{cc[0]}.{cc[1]}" if cc else ""
        if lost:
            card.error = lost[0]
        return card

    def read(self, slicing: bool) -> Reading:
        m = self.m
        try:
            count = m.nvmlDeviceGetCount()
        except Exception as exc:
            return Reading(error=f"NVML: {exc}", source=NVML)
        reading = Reading(source=NVML)
        for index in range(count):
            try:
                handle = m.nvmlDeviceGetHandleByIndex(index)
                card = self._card(handle, index)
            except Exception:
                continue  # unreadable here; the UUID check asks about it by UUID
            reading.cards.append(card)
            if slicing:
                try:
                    current, _pending = m.nvmlDeviceGetMigMode(handle)
                    reading.mig[card.uuid] = current == m.NVML_DEVICE_MIG_ENABLE
                except Exception:
                    reading.mig[card.uuid] = False
        if not reading.cards:
            reading.error = f"NVML reported {count} devices and none could be read"
            reading.no_devices = count == 0
        return reading

    def health(self) -> dict[str, dict]:
        """The same fields as `nvidia-smi -q -d ECC,...`, by UUID, plus each card's bus
        (under "_bus", for its Xid events). A call the card does not support is absent."""
        m = self.m
        out: dict[str, dict] = {}
        for index in range(m.nvmlDeviceGetCount()):
            try:
                handle = m.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(m.nvmlDeviceGetUUID(handle))
            except Exception:
                continue

            def get(call, handle=handle):
                try:
                    return call(handle)
                except Exception:
                    return None

            reading: dict = {}
            mode = get(m.nvmlDeviceGetEccMode)
            if mode:
                reading[hl.ECC_MODE] = "enabled" if mode[0] == m.NVML_FEATURE_ENABLED else "disabled"
            for name, kind, counter in (
                ("ecc_corrected_volatile", m.NVML_MEMORY_ERROR_TYPE_CORRECTED, m.NVML_VOLATILE_ECC),
                ("ecc_uncorrected_volatile", m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC),
                ("ecc_corrected_aggregate", m.NVML_MEMORY_ERROR_TYPE_CORRECTED, m.NVML_AGGREGATE_ECC),
                ("ecc_uncorrected_aggregate", m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_AGGREGATE_ECC),
            ):
                reading[name] = hl.count(get(lambda h, k=kind, c=counter: m.nvmlDeviceGetTotalEccErrors(h, k, c)))
            for name, cause in (
                ("retired_pages_single_bit", m.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
                ("retired_pages_double_bit", m.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
            ):
                pages = get(lambda h, c=cause: m.nvmlDeviceGetRetiredPages(h, c))
                reading[name] = len(pages) if pages is not None else None
            pending = get(m.nvmlDeviceGetRetiredPagesPendingStatus)
            reading["retired_pages_pending"] = None if pending is None else pending == m.NVML_FEATURE_ENABLED
            rows = get(m.nvmlDeviceGetRemappedRows)
            if rows:
                reading["remapped_rows_correctable"] = hl.count(rows[0])
                reading["remapped_rows_uncorrectable"] = hl.count(rows[1])
                reading["remapped_rows_pending"] = bool(rows[2])
                reading["remapped_rows_failure"] = bool(rows[3])
            reasons = get(m.nvmlDeviceGetCurrentClocksThrottleReasons)
            if reasons is not None:
                reading[hl.THROTTLE_REASONS] = [name for name, bit in _NVML_THROTTLES if int(reasons) & bit]
            pci = get(m.nvmlDeviceGetPciInfo)
            reading["_bus"] = hl.bus_key(_text(getattr(pci, "busId", b""))) if pci is not None else None
            out[uuid] = reading
        return out

    def probe(self, uuid: str) -> Card | str:
        try:
            handle = self.m.nvmlDeviceGetHandleByUUID(uuid)
            return self._card(handle, -1)
        except Exception as exc:
            return f"NVML: {exc}"


# nvmlClocksThrottleReason* bits (nvml.h) of the reasons a reading carries
_NVML_THROTTLES = (
    ("hw_slowdown", 0x08),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("sw_thermal_slowdown", 0x20),
)


def mig_instances(path: str, run: Runner, reading: Reading) -> dict[str, list[dict]]:
    """The MIG instances of the cards in MIG mode, by card UUID ({} when a listing failed:
    absent is "not known", never "none")."""
    try:
        by_index = list_instances(run, path)
    except ListingError:
        return {}
    return {
        card.uuid: by_index.get(card.index, [])
        for card in reading.cards
        if card.uuid and card.index is not None and reading.mig.get(card.uuid)
    }


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvidiaTool(VendorTool):
    vendor = "nvidia"
    tools = ("nvidia-smi",)

    def __init__(self, nvml: bool = False):
        self._want_nvml = nvml
        self._nvml: _Nvml | None = None
        self._fields = QUERY_FIELDS
        self._sections = hl.NVIDIA_SECTIONS
        self._kernel: hl.KernelLog | None = None

    def locate(self, root: str) -> str | None:
        path = super().locate(root)
        if self._want_nvml and self._nvml is None:
            self._nvml = _Nvml.load()
        if self._nvml is not None and path is None:
            return NVML
        return path

    def read(self, path: str, run: Runner, *, slicing: bool = False) -> Reading:
        if self._nvml is not None:
            reading = self._nvml.read(slicing)
            if not reading.error or path == NVML:
                return reading
        if path == NVML:
            return Reading(error="NVML is not loaded", source=NVML)
        result = run(query_argv(path, self._fields))
        if not result.ok and "compute_cap" in self._fields and "not a valid field" in result.stdout + result.stderr:
            # drivers before compute_cap existed reject the whole query; ask without it
            self._fields = tuple(f for f in self._fields if f != "compute_cap")
            result = run(query_argv(path, self._fields))
        reading = reading_from(result, lambda text: parse_query_csv(text, self._fields))
        if slicing and reading.cards:
            details = run([path, "-q"])
            if not (details.timed_out or details.error):
                reading.mig = parse_mig_modes(details.stdout)
            if any(reading.mig.values()):
                reading.mig_instances = mig_instances(path, run, reading)
        return reading

    def probe(self, path: str, run: Runner, card: str) -> Card | str:
        if self._nvml is not None:
            answer = self._nvml.probe(card)
            if isinstance(answer, Card) or path == NVML:
                return answer
        result = run(query_argv(path, self._fields, "-i", card))
        if result.timed_out or result.error:
            return result.describe()
        for found in parse_query_csv(result.stdout, self._fields):
            if found.uuid == card:
                return found
        return result.describe() if not result.ok else "nvidia-smi did not report this card"

    def health(self, path: str, run: Runner, keys: list[str], root: str = "/") -> dict[str, dict]:
        """Each card's reading by UUID, with its Xid events when the kernel log is
        readable. Raises HealthError when the tool itself failed (the detector keeps the
        last good reading)."""
        if self._kernel is None:
            self._kernel = hl.KernelLog(root, run)
        readable = self._kernel.read()
        if self._nvml is not None:
            by_uuid = self._nvml.health()
            buses = {uuid: reading.pop("_bus", None) for uuid, reading in by_uuid.items()}
        elif path == NVML:
            raise hl.HealthError("NVML is not loaded")
        else:
            by_uuid, buses = self._smi_health(path, run)
        for uuid, reading in by_uuid.items():
            if readable and buses.get(uuid) is not None:
                reading[hl.XID_EVENTS] = self._kernel.for_card(buses[uuid])
        return by_uuid

    def _smi_health(self, path: str, run: Runner) -> tuple[dict[str, dict], dict]:
        result = run([path, "-q", "-d", ",".join(self._sections)])
        if not result.ok and "ROW_REMAPPER" in self._sections and not result.timed_out and not result.error:
            # drivers before row remapping (R460) refuse the display type: ask without it
            self._sections = tuple(s for s in self._sections if s != "ROW_REMAPPER")
            result = run([path, "-q", "-d", ",".join(self._sections)])
        by_bus = {} if result.timed_out or result.error else hl.parse_nvidia_health(result.stdout)
        if not by_bus and not result.ok:
            raise hl.HealthError(result.describe())
        ids = run(query_argv(path, ("index", "uuid", "pci.bus_id")))
        if ids.timed_out or ids.error:
            raise hl.HealthError(ids.describe())
        uuids = hl.parse_bus_ids(ids.stdout)
        by_uuid, buses = {}, {}
        for bus, uuid in uuids.items():
            by_uuid[uuid] = dict(by_bus.get(bus, {}))
            buses[uuid] = bus
        return by_uuid, buses

    def topology(self, path: str, run: Runner) -> str | None:
        if path == NVML:
            return None
        result = run([path, "topo", "-m"])
        if result.timed_out or result.error or not result.stdout.strip():
            return None
        topology = parse_topology(result.stdout)
        if topology is None:
            return None
        return topology_label(topology) or None
