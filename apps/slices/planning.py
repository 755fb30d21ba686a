"""The pure rules of slicing: which tier a card gives a memory-only task and why, the MIG
profile tables per GPU model, the choice of a profile and whether it still fits on a
card, and a slice's compute share. No database, no Django (layer 2: it imports only the
slices' choices), so the scheduler's pure core and bind use the very same rules.

Tier (docs/scheduler.md, "Scheduling and tiers"), first match wins:

1. the node runs in a container: software accounting only (no hardware slicing from
   inside a container, whatever the card reports);
2. an NVIDIA card that reports MIG mode enabled: MIG (gold);
3. an NVIDIA card whose node reports an MPS control daemon alive: MPS (silver);
4. a Hygon card that reports the vDCU tool present and working: HAMi (silver);
5. anything else: software accounting (bronze).

The capability bits come from the agent's heartbeat (`gpu_capabilities[str(index)]`);
a bit that is absent is not known and never invented, so it counts as false.

MIG profiles: per model, the compute slices `g` (of the model's 7; the A30 has 4) and
the memory slices (of 8; the A30 has 4), with the profile's nominal memory in MB (the GB
of its name × 1024), from NVIDIA's MIG user guide ("Supported MIG Profiles"). The media
extension variants (+me) are left out: they are never the smallest fit for memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

from apps.slices.choices import QOS_OF_TIER, Tier

# --- MIG profile tables ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MigProfile:
    name: str  # as nvidia-smi mig -lgip names it, without "MIG ": 1g.10gb
    g: int  # compute slices
    memory_slices: int

    @property
    def memory_mb(self) -> int:
        """Nominal: the GB of the name × 1024 (1g.18gb: 18,432 MB)."""
        return profile_gb(self.name) * 1024


@dataclass(frozen=True, slots=True)
class MigModel:
    """One GPU model's MIG geometry and profiles (smallest first)."""

    key: str  # "A100 40GB"
    memory_gb: int  # the card's nominal memory
    compute_slices: int
    memory_slices: int
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile | None:
        return next((p for p in self.profiles if p.name == name), None)


def profile_gb(name: str) -> int:
    match = _PROFILE_NAME.match(name)
    return int(match.group(2)) if match else 0


_PROFILE_NAME = re.compile(r"^(\d+)g\.(\d+)gb")


def _model(key: str, memory_gb: int, rows: Iterable[tuple[str, int, int]], compute: int = 7, memory: int = 8):
    profiles = tuple(
        sorted((MigProfile(name, g, slices) for name, g, slices in rows), key=lambda p: (p.memory_mb, p.g))
    )
    return MigModel(key, memory_gb, compute, memory, profiles)


def _seven_by_eight(key: str, memory_gb: int, one: int, two: int, four: int) -> MigModel:
    """The geometry of A100 80GB, H100, H200, B200: 1g with 1 and 2 memory slices, 2g
    with 2, 3g and 4g with 4, 7g with all 8 (names from the nominal GB of each size)."""
    return _model(
        key,
        memory_gb,
        (
            (f"1g.{one}gb", 1, 1),
            (f"1g.{two}gb", 1, 2),
            (f"2g.{two}gb", 2, 2),
            (f"3g.{four}gb", 3, 4),
            (f"4g.{four}gb", 4, 4),
            (f"7g.{memory_gb}gb", 7, 8),
        ),
    )


MIG_MODELS: dict[str, MigModel] = {
    model.key: model
    for model in (
        # A100-SXM4-40GB / A100-PCIE-40GB (and A800 40GB): 1g.10gb is 1g with 2 memory slices
        _model(
            "A100 40GB",
            40,
            (
                ("1g.5gb", 1, 1),
                ("1g.10gb", 1, 2),
                ("2g.10gb", 2, 2),
                ("3g.20gb", 3, 4),
                ("4g.20gb", 4, 4),
                ("7g.40gb", 7, 8),
            ),
        ),
        _seven_by_eight("A100 80GB", 80, 10, 20, 40),  # and A800 80GB
        # A30: 4 compute slices and 4 memory slices
        _model("A30 24GB", 24, (("1g.6gb", 1, 1), ("2g.12gb", 2, 2), ("4g.24gb", 4, 4)), compute=4, memory=4),
        _seven_by_eight("H100 80GB", 80, 10, 20, 40),  # SXM5 and PCIe (and H800 80GB)
        _seven_by_eight("H100 NVL 94GB", 94, 12, 24, 47),
        _seven_by_eight("H100 96GB", 96, 12, 24, 48),  # GH200 96GB, H20
        _seven_by_eight("H200 141GB", 141, 18, 35, 71),  # H200 SXM and H200 NVL
        _seven_by_eight("GH200 144GB", 144, 18, 36, 72),
        _seven_by_eight("B200 180GB", 180, 23, 45, 90),
    )
}

# family (as it appears in the card's name) -> the models it may be, told apart by memory
_FAMILIES: dict[str, tuple[str, ...]] = {
    "A100": ("A100 40GB", "A100 80GB"),
    "A800": ("A100 40GB", "A100 80GB"),
    "A30": ("A30 24GB",),
    "H100": ("H100 80GB", "H100 NVL 94GB", "H100 96GB"),
    "H800": ("H100 80GB", "H100 NVL 94GB"),
    "H20": ("H100 96GB",),
    "H200": ("H200 141GB",),
    "GH200": ("H100 96GB", "GH200 144GB"),
    "B200": ("B200 180GB",),
}
_FAMILY = re.compile(r"(?<![A-Z0-9])(GH200|H200|H100|H800|H20|A100|A800|A30|B200)(?![A-Z0-9])")
_SIZE = re.compile(r"(?<![0-9])(\d{2,3})\s*G(?:B)?(?![A-Z0-9])")


@lru_cache(maxsize=256)
def mig_model(name: str, memory_total_mb: int | None = None) -> MigModel | None:
    """The MIG table of a card by its name as nvidia-smi prints it ("NVIDIA A100-SXM4-40GB",
    "NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL", "NVIDIA H200") and, to tell variants of a
    family apart, its total memory (MiB, as the agent reports it) or else a size in the
    name. None: a card whose model has no table here (no MIG slice is planned on it)."""
    upper = name.upper()
    found = _FAMILY.search(upper)
    if not found:
        return None
    candidates = [MIG_MODELS[key] for key in _FAMILIES[found.group(1)]]
    if found.group(1) in ("H100", "H800") and "NVL" in upper:
        return MIG_MODELS["H100 NVL 94GB"]
    if len(candidates) == 1:
        return candidates[0]
    if memory_total_mb:
        gib = memory_total_mb / 1024
        return min(candidates, key=lambda model: abs(model.memory_gb - gib))
    sizes = {int(size) for size in _SIZE.findall(upper[found.end() :])}
    named = [model for model in candidates if model.memory_gb in sizes]
    return named[0] if len(named) == 1 else None


# --- fitting on a card ----------------------------------------------------------------


def occupancy(model: MigModel, slices: Iterable[tuple[str, int]]) -> tuple[int, int]:
    """The compute and memory slices the card's LIVE slices take, each (profile, memory
    MB). A variant of a known profile (1g.18gb+me) counts as its base; a profile this
    table does not know (an orphan found on the card, say) is counted from its name's g
    and its memory, rounded up to whole memory slices; one that says nothing takes the
    whole card (fail-closed)."""
    used_g = used_memory = 0
    smallest = model.profiles[0]
    per_slice_mb = smallest.memory_mb // smallest.memory_slices
    for name, memory_mb in slices:
        # a variant (+me, +gfx, -me) takes the geometry of its base profile
        profile = model.profile(re.split(r"[+-]", name or "", maxsplit=1)[0])
        if profile is not None:
            used_g += profile.g
            used_memory += profile.memory_slices
            continue
        match = _PROFILE_NAME.match(name or "")
        megabytes = memory_mb or (profile_gb(name) * 1024 if match else 0)
        if not match or not megabytes:
            return model.compute_slices, model.memory_slices
        used_g += int(match.group(1))
        used_memory += max(1, -(-int(megabytes) // per_slice_mb))
    return used_g, used_memory


def profile_fits(model: MigModel, profile: MigProfile, used_g: int, used_memory: int) -> bool:
    return used_g + profile.g <= model.compute_slices and used_memory + profile.memory_slices <= model.memory_slices


def choose_profile(model: MigModel, memory_mb: int, used_g: int = 0, used_memory: int = 0) -> MigProfile | None:
    """The smallest profile (by memory, then compute) with at least `memory_mb` that
    still fits beside what the card's LIVE slices take; None when none does."""
    for profile in model.profiles:
        if profile.memory_mb >= memory_mb and profile_fits(model, profile, used_g, used_memory):
            return profile
    return None


def largest_fit_mb(model: MigModel | None, used_g: int, used_memory: int) -> int:
    """The most memory one more instance could have on the card (0: none fits, or no
    table). A request fits exactly when it is at most this."""
    if model is None:
        return 0
    return max(
        (p.memory_mb for p in model.profiles if profile_fits(model, p, used_g, used_memory)),
        default=0,
    )


# --- tiers ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TierChoice:
    tier: str
    why: str

    @property
    def qos(self) -> str:
        return QOS_OF_TIER[self.tier]

    @property
    def reason(self) -> dict:
        """As stored on the slice and shown on the task."""
        return {"tier": str(self.tier), "qos": str(self.qos), "why": self.why}


def tier_for(vendor: str, capability: Mapping | None, *, is_container: bool, index: int) -> TierChoice:
    """The tier a memory-only task gets on card `index` of a node (see the module's
    docstring), with the sentence that says why."""
    vendor = (vendor or "").lower()
    caps = capability if isinstance(capability, Mapping) else {}
    if is_container:
        return TierChoice(Tier.SOFTWARE, "the node runs in a container: software accounting only")
    if vendor == "nvidia":
        if caps.get("mig_capable") is True:
            return TierChoice(Tier.MIG, f"card {index} reports MIG mode enabled: a hardware partition")
        if caps.get("mps_capable") is True:
            return TierChoice(Tier.MPS, f"card {index} reports an MPS control daemon alive: per-client limits")
        if not caps:
            return TierChoice(Tier.SOFTWARE, f"card {index} reported no slicing capabilities: software accounting only")
        return TierChoice(
            Tier.SOFTWARE, f"card {index} reports neither MIG mode nor an MPS daemon: software accounting only"
        )
    if vendor == "hygon":
        if caps.get("hami_capable") is True:
            return TierChoice(Tier.HAMI, f"card {index} reports the vDCU tool working: HAMi cgroup limits")
        return TierChoice(Tier.SOFTWARE, f"card {index} reports no working vDCU tool: software accounting only")
    return TierChoice(
        Tier.SOFTWARE, f"{vendor or 'this vendor'}'s cards have no hardware slicing here: software accounting only"
    )


def is_mig(vendor: str, capability: Mapping | None, *, is_container: bool) -> bool:
    """tier_for(...) == MIG, without building the sentence (the scheduler's snapshot)."""
    return (
        not is_container
        and (vendor or "").lower() == "nvidia"
        and isinstance(capability, Mapping)
        and capability.get("mig_capable") is True
    )


def compute_percent(
    tier: str, *, memory_mb: int, memory_total_mb: int | None, profile: MigProfile | None = None, model=None
) -> int | None:
    """The slice's compute share: MIG, the profile's g of the model's compute slices
    (round(100·g/7); the A30's of 4); MPS and HAMi, the memory share (memory_mb over the
    card's total, rounded, at least 1, at most 100; None when the total is unknown);
    software: None (nothing limits compute)."""
    if tier == Tier.MIG:
        if profile is None:
            return None
        slices = model.compute_slices if model is not None else 7
        return round(100 * profile.g / slices)
    if tier in (Tier.MPS, Tier.HAMI):
        if not memory_total_mb:
            return None
        return max(1, min(100, round(100 * memory_mb / memory_total_mb)))
    return None


# --- the plan of one slice ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SlicePlan:
    tier: str
    reason: dict  # {"tier", "qos", "why"}
    memory_mb: int  # what is carved (MIG: the profile's memory)
    compute_percent: int | None
    profile: str  # MIG only


@dataclass(frozen=True, slots=True)
class Refusal:
    code: str  # SliceUnplannable
    message: str


def plan_slice(
    *,
    vendor: str,
    model_name: str,
    memory_total_mb: int | None,
    capability: Mapping | None,
    is_container: bool,
    index: int,
    memory_mb: int,
    live: Iterable[tuple[str, int]] = (),
) -> SlicePlan | Refusal:
    """The slice a memory-only task of `memory_mb` would get on this card, whose LIVE
    slices are `live` ((profile, memory MB) each), or why none can be planned. Only MIG
    can refuse here (no table for the model, or no profile left that fits); the other
    tiers' memory room is the ledger's (the scheduler's capacity check)."""
    choice = tier_for(vendor, capability, is_container=is_container, index=index)
    if choice.tier != Tier.MIG:
        percent = compute_percent(choice.tier, memory_mb=memory_mb, memory_total_mb=memory_total_mb)
        return SlicePlan(choice.tier, choice.reason, memory_mb, percent, "")
    model = mig_model(model_name or "", memory_total_mb)
    if model is None:
        return Refusal(
            "SliceUnplannable", f"card {index} is in MIG mode but its model {model_name!r} has no MIG profile table"
        )
    used_g, used_memory = occupancy(model, live)
    profile = choose_profile(model, memory_mb, used_g, used_memory)
    if profile is None:
        biggest = model.profiles[-1].memory_mb if model.profiles else 0
        if memory_mb > biggest:
            message = f"no MIG profile of {model.key} has {memory_mb} MB (the largest has {biggest} MB)"
        else:
            message = (
                f"card {index} ({model.key}) has no MIG profile of {memory_mb} MB or more left: "
                f"{used_g}/{model.compute_slices} compute and {used_memory}/{model.memory_slices} memory slices taken"
            )
        return Refusal("SliceUnplannable", message)
    percent = compute_percent(Tier.MIG, memory_mb=memory_mb, memory_total_mb=None, profile=profile, model=model)
    why = choice.reason | {"why": f"{choice.why}; profile {profile.name} ({model.key})"}
    return SlicePlan(Tier.MIG, why, profile.memory_mb, percent, profile.name)
