"""The small schema checker the other tests rely on must actually reject bad shapes."""

from __future__ import annotations

import pytest

from .conftest import SchemaError


@pytest.mark.parametrize(
    "bad",
    [
        {"gpu_stats": [{"index": 0}]},  # vendor missing
        {"gpu_stats": [{"index": 0, "vendor": "intel"}]},  # not in the enum
        {"gpu_stats": [{"index": 64, "vendor": "nvidia"}]},  # out of range
        {"gpu_stats": [{"index": 0, "vendor": "nvidia", "utilization": 101}]},
        {"gpu_stats": [{"index": 0, "vendor": "nvidia", "memory_used_mb": 1.5}]},
        {"gpu_stats": [{"index": 0, "vendor": "nvidia", "fan": 30}]},  # unknown key
        {"gpu_stats": [{"index": 0, "vendor": "nvidia", "metrics_available": ["fan"]}]},
        {"gpu_collect_failures": [{"uuid": "GPU-1"}]},
        {"gpu_capabilities": {"zero": {"best_tier": 1}}},
        {"gpu_capabilities": {"0": {"best_tier": 10}}},
        {"gpu_collector_error": 1},
        {"labels": {"heteroflow.io/gpu-topology": {"nvlink": []}}},
    ],
)
def test_checker_rejects(validate, bad):
    with pytest.raises(SchemaError):
        validate(bad)


def test_checker_accepts_a_full_card(validate):
    validate(
        {
            "gpu_stats": [
                {
                    "index": 0,
                    "vendor": "nvidia",
                    "uuid": "GPU-1",
                    "model": "X",
                    "memory_total_mb": 1,
                    "memory_used_mb": 0,
                    "utilization": 0,
                    "temperature": -5.5,
                    "power_w": 0.0,
                    "compute_capability": "9.0",
                    "metrics_available": ["utilization", "memory_used_mb"],
                }
            ],
            "gpu_collect_failures": [{"index": 1, "uuid": "GPU-2", "error": "gone"}],
            "gpu_capabilities": {"0": {"mig_capable": True, "mps_capable": False, "best_tier": 1}},
            "labels": {"heteroflow.io/gpu-topology": "{}"},
            "gpu_collector_error": "",
            "is_container": False,
        }
    )
