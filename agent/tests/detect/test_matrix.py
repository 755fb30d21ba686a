"""The capability matrix is pinned: every vendor in the heartbeat's enum and every
detector in the chain has a row, and the spec's lost-GPU classes hold."""

from __future__ import annotations

from heteroflow_agent.detect import MATRIX
from heteroflow_agent.detect.matrix import ATTRIBUTIONS, FULL, NONE, PARTIAL
from heteroflow_agent.detect.registry import DETECTORS
from heteroflow_agent.detect.virtual import VENDOR as VIRTUAL

# The spec's priority order (domestic first), then AMD; virtual is the fallback.
SPEC_ORDER = [
    "musa",
    "hygon",
    "cambricon",
    "biren",
    "ascend",
    "kunlun",
    "iluvatar",
    "nvidia",
    "metax",
    "enflame",
    "amd",
]


def test_the_chain_is_in_the_spec_order():
    assert [cls.vendor for cls in DETECTORS] == SPEC_ORDER


def test_every_vendor_is_classified(schema):
    """Adding a detector (or a vendor to the schema) without a matrix row fails here."""
    enum = set(schema["$defs"]["vendor"]["enum"])
    chain = {cls.vendor for cls in DETECTORS} | {VIRTUAL}
    assert set(MATRIX) == enum == chain


def test_rows_only_name_metrics_the_schema_knows(schema):
    metric_names = set(schema["$defs"]["metric_name"]["enum"])
    for vendor, row in MATRIX.items():
        assert row.metrics <= metric_names, vendor
        assert row.attribution in ATTRIBUTIONS, vendor


def test_the_spec_lost_gpu_classes():
    by_class = {a: {v for v, row in MATRIX.items() if row.attribution == a} for a in ATTRIBUTIONS}
    assert by_class[FULL] == {"nvidia"}
    assert {"ascend", "kunlun", "cambricon"} <= by_class[PARTIAL]
    assert {"hygon", "iluvatar", "biren", "musa", "metax", "enflame"} <= by_class[NONE]
    assert by_class[PARTIAL] - {"ascend", "kunlun", "cambricon"} == {"amd"}  # not in the spec; see amd.py


def test_spec_metric_rules():
    assert "power_w" not in MATRIX["ascend"].metrics  # no trusted sample, per the spec
    assert MATRIX["biren"].metrics == {"utilization", "memory_used_mb"}
    assert MATRIX["virtual"].metrics == frozenset()
    assert [v for v, row in MATRIX.items() if row.compute_capability] == ["nvidia"]
