"""The capability matrix: per vendor, which metrics its tool can give and whether a
failed card can be attributed to that card.

It is a table so that a reviewer sees every vendor's promise in one place, and a test
pins it: a vendor added to the detector chain without a row here, or a vendor in the
schema's enum without one, fails the build. Readers may parse more than a row allows;
the detector drops whatever the row does not list, so the matrix is what is sent.

Attribution (the spec's lost-GPU matrix):
- full: each card is checked by UUID, and a card that fails is named even when it is
  the only one (NVIDIA).
- partial: the tool names each card, so a card missing while others answer is reported
  against that card; a one-card node, or every card failing at once, looks like the
  tool failing and is reported as a collector error (Ascend, Kunlun, Cambricon; AMD by
  the same reasoning).
- none: the output is matched by position, and the tool renumbers the cards after one
  that disappears; nothing is reported per card. Each card's UUID or PCI address, where
  the tool prints one, is sent with it, and the server names the card that went by it;
  without either, which card went cannot be told (the heartbeat's gpu_index_basis says
  the indices are positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .health import COUNTERS, ECC_COUNTERS, ECC_MODE, FLAGS, THROTTLE_REASONS, XID_EVENTS

FULL = "full"
PARTIAL = "partial"
NONE = "none"
ATTRIBUTIONS = (FULL, PARTIAL, NONE)

UTIL, MEM, TEMP, POWER = "utilization", "memory_used_mb", "temperature", "power_w"


@dataclass(frozen=True)
class VendorCapability:
    tools: str  # the tool names, for people reading the table
    metrics: frozenset[str]
    attribution: str
    compute_capability: bool = False
    # the card health fields its tool documents (gpu_health); empty: none, never zeros
    health: frozenset[str] = field(default_factory=frozenset)


def _m(*names: str) -> frozenset[str]:
    return frozenset(names)


NVIDIA_HEALTH = frozenset({ECC_MODE, *COUNTERS, *FLAGS, XID_EVENTS, THROTTLE_REASONS})
# amd-smi metric --ecc: the totals since the driver loaded
AMD_HEALTH = frozenset({"ecc_corrected_volatile", "ecc_uncorrected_volatile"})
# npu-smi info -t ecc: single/double bit counts, their aggregate totals, isolated pages
ASCEND_HEALTH = frozenset({*ECC_COUNTERS, "retired_pages_single_bit", "retired_pages_double_bit"})

MATRIX = {
    # Metrics follow the spec's detector table; power is parsed where the tool prints it
    # in watts, except Ascend, whose power field the spec leaves out for want of a
    # trusted sample, and Biren, whose tool the spec credits with utilisation and memory
    # only.
    "musa": VendorCapability("mthreads-gmi", _m(UTIL, MEM, TEMP), NONE),
    "hygon": VendorCapability("hy-smi", _m(UTIL, MEM, TEMP, POWER), NONE),
    "cambricon": VendorCapability("cnmon", _m(UTIL, MEM, TEMP, POWER), PARTIAL),
    "biren": VendorCapability("brsmi / birensmi", _m(UTIL, MEM), NONE),
    "ascend": VendorCapability("npu-smi", _m(UTIL, MEM, TEMP), PARTIAL, health=ASCEND_HEALTH),
    "kunlun": VendorCapability("xpu_smi / xpu-smi", _m(UTIL, MEM, TEMP, POWER), PARTIAL),
    "iluvatar": VendorCapability("ixsmi", _m(UTIL, MEM, TEMP, POWER), NONE),
    "nvidia": VendorCapability(
        "NVML / nvidia-smi", _m(UTIL, MEM, TEMP, POWER), FULL, compute_capability=True, health=NVIDIA_HEALTH
    ),
    "metax": VendorCapability("mx-smi", _m(UTIL, MEM, TEMP, POWER), NONE),
    "enflame": VendorCapability("efsmi", _m(UTIL, MEM, TEMP, POWER), NONE),
    "amd": VendorCapability("amd-smi / rocm-smi", _m(UTIL, MEM, TEMP, POWER), PARTIAL, health=AMD_HEALTH),
    "virtual": VendorCapability("built in", _m(), NONE),
}
