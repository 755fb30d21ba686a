"""The detector: which vendor this machine is, and one GPU reading per heartbeat.

The chain of vendor tools is walked once (it is a few stat calls per vendor, but a
tool run for the first vendor found); after that only the chosen vendor's tool runs,
one or two runs per beat, so `detect()` is cheap at a 5 s interval. A machine that fell
back to the virtual GPU walks the chain again every `rescan_every` calls, so a driver
installed after the agent is picked up without a restart.

Failures are kept apart from absence. A tool that is missing, hangs or prints nothing
usable is a `collector_error` with no cards, which the server reads as "this beat says
nothing", never as "every card is gone". A single card is reported as failed only when
the vendor's output can name it (the capability matrix), so a healthy card is never
blamed for its neighbour.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from . import health as hl
from . import slicing
from .base import VendorTool
from .command import DEFAULT_TIMEOUT, ToolResult, run_tool
from .matrix import FULL, MATRIX, PARTIAL, VendorCapability
from .model import METRICS, Card, Detection, Reading
from .nvidia import NVML, TOPOLOGY_LABEL, NvidiaTool
from .registry import DETECTORS
from .virtual import VENDOR as VIRTUAL
from .virtual import virtual_card

log = logging.getLogger(__name__)

MAX_CARDS = 64  # the schema's bound on gpu_stats and card indices
_RANGES = {
    "utilization": (0.0, 100.0),
    "temperature": (-50.0, 200.0),
    "power_w": (0.0, 10000.0),
}


@dataclass
class _Known:
    index: int
    uuid: str = ""


class Detector:
    """Keep one per agent: it remembers the vendor, its tool and the cards it has seen."""

    def __init__(
        self,
        root: str = "/",
        timeout: float = DEFAULT_TIMEOUT,
        is_container: bool | None = None,
        *,
        nvml: bool | None = None,
        rescan_every: int = 12,
        detectors: Iterable[type] | None = None,
        health_every: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.root = root or "/"
        self.timeout = float(timeout)
        self._container_given = is_container
        self._container: bool | None = None
        # NVML reads the real machine and cannot be pointed at a scratch root
        use_nvml = os.path.abspath(self.root) == "/" if nvml is None else nvml
        self._tools: list[VendorTool] = [
            cls(nvml=use_nvml) if cls is NvidiaTool else cls() for cls in (detectors or DETECTORS)
        ]
        self._rescan_every = max(1, int(rescan_every))
        self._tool: VendorTool | None = None
        self._path = ""
        self._known: dict[str, _Known] = {}
        self._topology: str | None = None
        self._topology_tried = 0  # the call number of the last attempt
        self._calls = 0
        self._last_error = ""
        self._health_every = float(health_every)
        self._clock = clock
        self._health: list[dict] | None = None  # the last good reading, sent until the next
        self._health_at: float | None = None
        self._health_error = ""
        self._lock = threading.Lock()

    # -- the public side -------------------------------------------------------

    @property
    def is_container(self) -> bool:
        if self._container_given is not None:
            return bool(self._container_given)
        if self._container is None:
            self._container = slicing.is_container(self.root)
        return self._container

    @property
    def vendor(self) -> str | None:
        """The vendor chosen so far (None before the first call or while virtual)."""
        return self._tool.vendor if self._tool else None

    def run(self, argv) -> ToolResult:
        return run_tool(argv, self.timeout)

    def detect(self) -> Detection:
        with self._lock:
            self._calls += 1
            container = self.is_container
            try:
                if self._tool is None:
                    rescan = (self._calls - 1) % self._rescan_every == 0
                    reading = self._select(container) if rescan else None
                    if reading is None:
                        return self._virtual(container)
                else:
                    reading = self._read(container)
                return self._assemble(reading, container)
            except Exception as exc:  # a bug here must cost one beat's GPU part, not the beat
                log.exception("gpu detection failed")
                vendor = self._tool.vendor if self._tool else VIRTUAL
                return Detection(
                    vendor=vendor,
                    is_container=container,
                    collector_error=f"gpu detection failed: {type(exc).__name__}: {exc}"[:2000],
                )

    # -- choosing the vendor ---------------------------------------------------

    def _select(self, container: bool) -> Reading | None:
        """The first vendor in priority order whose tool is here claims the machine.

        A tool that is present but fails still claims it (a broken driver on a GPU
        server must not pass for a GPU-less machine); only a tool that plainly says
        "no devices" lets the chain go on.
        """
        for tool in self._tools:
            path = tool.locate(self.root)
            if not path:
                continue
            reading = tool.read(path, self.run, slicing=not container)
            if reading.no_devices and not reading.cards:
                log.info("gpu detect: %s found at %s but reports no devices; trying the next vendor", tool.vendor, path)
                continue
            self._tool, self._path = tool, path
            log.info("gpu detect: vendor %s via %s", tool.vendor, path)
            return reading
        return None

    def _read(self, container: bool) -> Reading:
        if self._path != NVML and not os.path.exists(self._path):
            return Reading(error=f"{os.path.basename(self._path)} is no longer at {self._path}", source=self._path)
        return self._tool.read(self._path, self.run, slicing=not container)

    # -- turning a reading into a detection ------------------------------------

    def _virtual(self, container: bool) -> Detection:
        return Detection(
            vendor=VIRTUAL,
            gpus=[virtual_card()],
            capabilities=slicing.capabilities([(0, "")], nvidia=False, mig={}, mps_alive=False, container=container),
            virtual=True,
            is_container=container,
            failure_attribution=MATRIX[VIRTUAL].attribution,
        )

    def _assemble(self, reading: Reading, container: bool) -> Detection:
        tool = self._tool
        row = MATRIX[tool.vendor]
        result = Detection(
            vendor=tool.vendor,
            is_container=container,
            tool=reading.source or self._path,
            failure_attribution=row.attribution,
        )
        if not reading.cards:
            return self._failed(result, reading.error or f"no cards in the output of {self._tool_name()}")
        if row.attribution == FULL:
            cards, failures = self._check_by_uuid(reading)
        elif row.attribution == PARTIAL:
            cards, failures = self._check_by_key(reading)
        else:
            cards, failures = self._by_position(reading), []
        if not cards and not failures:  # rows, but none that can be trusted to be a card
            return self._failed(result, f"no card could be identified in the output of {self._tool_name()}")
        self._note("")
        result.gpus = _unique_identities([self._stat(index, card, tool.vendor, row) for index, card in cards])
        result.collect_failures = failures
        nvidia = tool.vendor == "nvidia"
        mps = nvidia and not container and slicing.mps_daemon_alive(self.root)
        result.capabilities = slicing.capabilities(
            [(g["index"], g.get("uuid", "")) for g in result.gpus],
            nvidia=nvidia,
            mig=reading.mig,
            mps_alive=mps,
            container=container,
            mig_instances=reading.mig_instances,
            # a Hygon node in a container carves nothing: known, so said (false)
            hami=(reading.hami if reading.hami is not None else {} if container else None)
            if tool.vendor == "hygon"
            else None,
        )
        retry = not self._topology_tried or self._calls - self._topology_tried >= self._rescan_every
        if nvidia and self._topology is None and retry:
            self._topology_tried = self._calls
            self._topology = tool.topology(self._path, self.run)
        result.labels = self._labels()
        result.health = self._card_health(row)
        return result

    def _card_health(self, row: VendorCapability) -> list[dict] | None:
        """The cards' health, read every `health_every` seconds and cached between. A read
        that fails keeps the last good reading (a failing health read never costs the
        beat); a vendor whose tool documents no health fields sends none."""
        if not row.health:
            return None
        now = self._clock()
        if self._health_at is not None and now - self._health_at < self._health_every:
            return self._health
        self._health_at = now
        try:
            by_key = self._tool.health(self._path, self.run, list(self._known), self.root)
        except Exception as exc:  # HealthError, or a parser bug: log it, keep the last reading
            error = f"{type(exc).__name__}: {exc}"
            if error != self._health_error:
                log.warning("gpu health read failed (the last reading is kept): %s", error)
            self._health_error = error
            return self._health
        if self._health_error:
            log.info("gpu health read recovered")
        self._health_error = ""
        if by_key is None:
            self._health = None
            return None
        readings = []
        for key, reading in by_key.items():
            known = self._known.get(key)
            if known is None:
                continue
            card = hl.finish(reading, row.health)
            if card["available"]:
                readings.append({"index": known.index, **card})
        self._health = sorted(readings, key=lambda r: r["index"])
        return self._health

    def _failed(self, result: Detection, error: str) -> Detection:
        """The collection failed as a whole: an error and no cards, never "no cards"."""
        result.collector_error = error[:2000]
        result.labels = self._labels()  # the topology has not changed because a read failed
        self._note(result.collector_error)
        return result

    def _labels(self) -> dict[str, str]:
        return {TOPOLOGY_LABEL: self._topology} if self._topology else {}

    def _note(self, error: str) -> None:
        if error != self._last_error:
            if error:
                log.warning("gpu collection failed: %s", error)
            elif self._last_error:
                log.info("gpu collection recovered")
        self._last_error = error

    # -- attribution -------------------------------------------------------------

    def _enroll(self, cards: Iterable[Card]) -> None:
        """Give each card seen for the first time a stable index: the tool's own when it
        is free, else the lowest free one. Kept for the life of the detector, so a card
        that drops off keeps its place and can be reported."""
        taken = {k.index for k in self._known.values()}
        for card in cards:
            if card.key in self._known or len(self._known) >= MAX_CARDS:
                continue
            index = card.index
            if index is None or not 0 <= index < MAX_CARDS or index in taken:
                index = next(i for i in range(MAX_CARDS) if i not in taken)
            taken.add(index)
            self._known[card.key] = _Known(index, card.uuid)

    def _failure(self, known: _Known, error: str) -> dict:
        failure = {"index": known.index, "error": (error or "card failed")[:1000]}
        if known.uuid:
            failure["uuid"] = known.uuid[:128]
        return failure

    def _check_by_uuid(self, reading: Reading) -> tuple[list[tuple[int, Card]], list[dict]]:
        """NVIDIA: every known card checked by UUID; one that is missing is asked about
        on its own, and what the tool says about it is the failure reported."""
        seen: dict[str, Card] = {}
        for card in reading.cards:
            if card.uuid:  # a row whose UUID is unreadable cannot be trusted to be any card
                card.key = card.uuid
                seen.setdefault(card.uuid, card)
        self._enroll(seen.values())
        cards, failures = [], []
        probing = True
        for key, known in sorted(self._known.items(), key=lambda item: item[1].index):
            card = seen.get(key)
            if card is None:
                if not probing:
                    failures.append(self._failure(known, f"not reported by {self._tool_name()}"))
                    continue
                answer = self._tool.probe(self._path, self.run, key)
                if isinstance(answer, Card) and not answer.error:
                    card = answer
                else:
                    error = answer.error if isinstance(answer, Card) else answer
                    failures.append(self._failure(known, error))
                    probing = "timed out" not in error  # a hung tool is not asked again this beat
                    continue
            if card.error:
                failures.append(self._failure(known, card.error))
                continue
            cards.append((known.index, card))
        return cards, failures

    def _check_by_key(self, reading: Reading) -> tuple[list[tuple[int, Card]], list[dict]]:
        """Ascend, Kunlun, Cambricon, AMD: the tool names each card, so a known card it
        leaves out while others answer is reported against that card."""
        present: dict[str, Card] = {}
        for card in reading.cards:
            present.setdefault(card.key, card)
        self._enroll(present.values())
        cards, failures = [], []
        for key, known in sorted(self._known.items(), key=lambda item: item[1].index):
            card = present.get(key)
            if card is None:
                failures.append(self._failure(known, f"{self._tool_name()} did not report this card"))
            elif card.error:
                failures.append(self._failure(known, card.error))
            else:
                cards.append((known.index, card))
        return cards, failures

    def _by_position(self, reading: Reading) -> list[tuple[int, Card]]:
        """Vendors matched by position: the cards as printed, nothing kept between beats."""
        usable = [c for c in reading.cards if not c.error][:MAX_CARDS]
        indices = [c.index for c in usable]
        trusted = all(i is not None and 0 <= i < MAX_CARDS for i in indices) and len(set(indices)) == len(indices)
        return [(card.index if trusted else position, card) for position, card in enumerate(usable)]

    def _tool_name(self) -> str:
        return "NVML" if self._path == NVML else os.path.basename(self._path)

    # -- one card ----------------------------------------------------------------

    @staticmethod
    def _stat(index: int, card: Card, vendor: str, row: VendorCapability) -> dict:
        """A schema gpu_stat: only what was read this round, only what the matrix allows."""
        stat: dict = {"index": index, "vendor": vendor}
        if card.uuid:
            stat["uuid"] = card.uuid.strip()[:128]
        if card.pci_bus_id:
            stat["pci_bus_id"] = card.pci_bus_id
        if card.model and card.model.strip():
            stat["model"] = card.model.strip()[:200]
        if card.memory_total_mb is not None and card.memory_total_mb >= 0:
            stat["memory_total_mb"] = int(card.memory_total_mb)
        for name in METRICS:
            value = getattr(card, name)
            if value is None or name not in row.metrics:
                continue
            if name == "memory_used_mb":
                if value >= 0:
                    stat[name] = int(value)
                continue
            low, high = _RANGES[name]
            if low <= value <= high:
                stat[name] = int(value) if float(value).is_integer() else round(float(value), 2)
        if row.compute_capability and card.compute_capability:
            stat["compute_capability"] = card.compute_capability[:20]
        stat["metrics_available"] = [name for name in METRICS if name in stat]
        return stat


def _unique_identities(stats: list[dict]) -> list[dict]:
    """The cards as read, less any UUID or PCI address that more than one of them shows:
    the server tells cards apart by these, and one shared by two cards (a tool printing
    a placeholder) would make it name the wrong one. Such a card is then known by its
    index alone, as a tool that prints no identity leaves it."""
    for field in ("uuid", "pci_bus_id"):
        values = [stat[field] for stat in stats if stat.get(field)]
        shared = {value for value in values if values.count(value) > 1}
        if shared:
            log.warning("gpu detect: %s shared by several cards, not sent: %s", field, ", ".join(sorted(shared)))
            for stat in stats:
                if stat.get(field) in shared:
                    del stat[field]
    return stats
