"""GPU detection for the node agent.

Keep one `Detector` per agent and call `detect()` on it every heartbeat; the
module-level `detect()` does the same with a detector kept per (root, timeout,
is_container), for callers that do not want to hold one.

    from heteroflow_agent.detect import detect, Detection, find_command
    result = detect(root="/", timeout=10.0, is_container=None)
    payload.update(result.heartbeat_fields())
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

from .command import DEFAULT_TIMEOUT, find_command, run_tool
from .detector import Detector
from .matrix import MATRIX
from .model import Detection

__all__ = ["detect", "Detection", "Detector", "find_command", "run_tool", "MATRIX", "DEFAULT_TIMEOUT"]

_detectors: dict[tuple[str, float, bool | None], Detector] = {}
_detectors_lock = threading.Lock()


def detect(root: str = "/", timeout: float = DEFAULT_TIMEOUT, is_container: bool | None = None) -> Detection:
    """One reading of this machine's GPUs, reusing the detector kept for these arguments
    so that the vendor is found once and known cards are remembered between calls."""
    key = (root, float(timeout), is_container)
    with _detectors_lock:
        detector = _detectors.get(key)
        if detector is None:
            detector = _detectors[key] = Detector(root, timeout, is_container)
    return detector.detect()
