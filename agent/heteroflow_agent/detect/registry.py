"""The detector chain, in the spec's priority order (domestic accelerators first),
then AMD, then the virtual fallback.

The order decides which vendor a machine is, not how the scheduler weighs it. It is
data so a test can compare it with the spec and with the capability matrix.
"""

from __future__ import annotations

from .amd import AmdTool
from .ascend import AscendTool
from .biren import BirenTool
from .cambricon import CambriconTool
from .enflame import EnflameTool
from .hygon import HygonTool
from .iluvatar import IluvatarTool
from .kunlun import KunlunTool
from .metax import MetaxTool
from .musa import MusaTool
from .nvidia import NvidiaTool

DETECTORS = (
    MusaTool,
    HygonTool,
    CambriconTool,
    BirenTool,
    AscendTool,
    KunlunTool,
    IluvatarTool,
    NvidiaTool,
    MetaxTool,
    EnflameTool,
    AmdTool,
)
