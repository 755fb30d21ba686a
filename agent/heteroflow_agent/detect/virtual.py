"""The virtual GPU: what a machine with no vendor tool reports.

One card, so that a GPU-less machine (a CPU worker, a developer laptop) still
registers and can run CPU tasks. It claims nothing it did not measure: no memory, no
metrics, and the detection says `virtual=True`.
"""

from __future__ import annotations

VENDOR = "virtual"
MODEL = "Virtual GPU"


def virtual_card() -> dict:
    return {"index": 0, "vendor": VENDOR, "model": MODEL, "metrics_available": []}
