"""What a vendor reader hands the detector, and what the detector hands the heartbeat.

A reader only parses: it says which cards the tool printed and what it could read for
each. Deciding what a missing card means (a lost card, or nothing we can tell) is the
detector's job, from the capability matrix, so the rule lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Order of the schema's `metric_name` enum: the order metrics_available is written in.
METRICS = ("utilization", "memory_used_mb", "temperature", "power_w")


@dataclass
class Card:
    """One card as a tool printed it. None means "not read this round", never 0."""

    key: str  # the tool's own identity for the card: UUID, "npu-chip", card number
    index: int | None = None  # the tool's own index, when it prints one
    uuid: str = ""
    # where the card sits: "0000:3f:00.0" (parsing.pci_bus_id), "" when the tool prints none.
    # With the UUID, what tells a card from its neighbours when a tool renumbers them.
    pci_bus_id: str = ""
    model: str = ""
    memory_total_mb: int | None = None
    memory_used_mb: int | None = None
    utilization: float | None = None
    temperature: float | None = None
    power_w: float | None = None
    compute_capability: str = ""
    error: str = ""  # the tool itself said this card failed ("[GPU is lost]")

    def read_anything(self) -> bool:
        """Whether anything at all was read for this card (a bare heading is no card)."""
        values = (self.utilization, self.temperature, self.power_w, self.memory_total_mb, self.memory_used_mb)
        return bool(self.model or self.uuid or self.pci_bus_id) or any(v is not None for v in values)


@dataclass
class Reading:
    """One run of a vendor tool (or one NVML pass)."""

    cards: list[Card] = field(default_factory=list)
    error: str = ""  # the tool failed as a whole: missing, hung, garbage, nothing printed
    no_devices: bool = False  # the tool ran and said plainly that there is no card
    mig: dict[str, bool] = field(default_factory=dict)  # uuid -> MIG mode currently Enabled
    # uuid -> the card's MIG instances, only for cards in MIG mode whose listing worked
    mig_instances: dict[str, list[dict]] = field(default_factory=dict)
    hami: dict[int, bool] | None = None  # card index -> the vDCU tool works (Hygon); None: not asked
    source: str = ""  # the tool path (or "nvml") the reading came from


@dataclass
class Detection:
    """The GPU part of one heartbeat.

    `collector_error` non-empty means the collection failed as a whole: `gpus` is then
    empty and must not be read as "every card is gone" (the server distrusts the whole
    beat instead of counting cards absent).
    """

    vendor: str
    gpus: list[dict] = field(default_factory=list)
    collect_failures: list[dict] = field(default_factory=list)
    collector_error: str = ""
    capabilities: dict[str, dict] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    virtual: bool = False
    is_container: bool = False
    tool: str = ""  # what produced the reading: a tool path, "nvml", or "" (virtual)
    failure_attribution: str = "none"  # from the capability matrix: full / partial / none
    # gpu_health: one reading per card whose health could be read (read every 30 s and
    # cached between); None: this vendor reports no health, or none was read yet
    health: list[dict] | None = None

    @property
    def collection_failed(self) -> bool:
        return bool(self.collector_error)

    @property
    def index_basis(self) -> str:
        """What a card's index means (the heartbeat's `gpu_index_basis`). "stable": the
        detector gives each card its index when first seen and keeps it while the agent
        runs (the vendors whose tool names each card: full or partial attribution).
        "position": the index is the card's place in the tool's list now, and the tool
        renumbers the cards after one that drops out; the server then tells cards apart by
        their UUID or PCI address, and where a card has neither, says that a card that
        went missing cannot be told."""
        return "position" if self.failure_attribution == "none" else "stable"

    def heartbeat_fields(self) -> dict:
        """The heartbeat keys this detection fills, shaped as the schema wants them."""
        fields = {
            "gpu_stats": [dict(g) for g in self.gpus],
            "gpu_collect_failures": [dict(f) for f in self.collect_failures],
            "gpu_capabilities": {k: dict(v) for k, v in self.capabilities.items()},
            "gpu_index_basis": self.index_basis,
            "labels": dict(self.labels),
            "is_container": self.is_container,
        }
        if self.collector_error:
            fields["gpu_collector_error"] = self.collector_error
        if self.health:
            fields["gpu_health"] = [dict(h) for h in self.health]
        return fields
