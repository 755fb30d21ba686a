"""The small schema checker the other tests rely on must actually reject bad shapes."""

from __future__ import annotations

import pytest

from heteroflow_agent.detect.health import COUNTERS, FIELDS, FLAGS, THROTTLES

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
        {"gpu_health": [{"available": []}]},  # index missing
        {"gpu_health": [{"index": 0}]},  # available missing
        {"gpu_health": [{"index": 0, "available": [], "ecc_uncorrected_volatile": -1}]},
        {"gpu_health": [{"index": 0, "available": [], "ecc_corrected_volatile": 1.5}]},
        {"gpu_health": [{"index": 0, "available": [], "remapped_rows_failure": "No"}]},
        {"gpu_health": [{"index": 0, "available": [], "ecc_mode": "on"}]},
        {"gpu_health": [{"index": 0, "available": ["fan"]}]},
        {"gpu_health": [{"index": 0, "available": [], "throttle_reasons": ["sw_power_cap"]}]},
        {"gpu_health": [{"index": 0, "available": [], "xid_events": [{"code": 79}]}]},  # no time
        {"gpu_health": [{"index": 0, "available": [], "xid_events": [{"code": 79, "at": "yesterday"}]}]},
        {
            "gpu_health": [
                {
                    "index": 0,
                    "available": [],
                    "xid_events": [{"code": 79, "at": "2026-12-01T10:00:00Z", "text": "x" * 501}],
                }
            ]
        },
        {
            "gpu_health": [
                {"index": 0, "available": [], "xid_events": [{"code": 79, "at": "2026-12-01T10:00:00Z"}] * 33}
            ]
        },
        {"gpu_health": [{"index": 0, "available": [], "temperature": 40}]},  # unknown key
        {"cpu_model": ""},
        {"cpu_sockets": 0},
        {"cpu_sockets": "2"},
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


def test_checker_accepts_a_full_health_reading(validate):
    validate(
        {
            "cpu_model": "Intel(R) Xeon(R) Platinum 8480+",
            "cpu_sockets": 2,
            "gpu_health": [
                {
                    "index": 0,
                    "available": list(FIELDS),
                    "ecc_mode": "enabled",
                    **{name: 0 for name in COUNTERS},
                    **{name: False for name in FLAGS},
                    "xid_events": [{"code": 79, "at": "2026-12-01T10:00:00Z", "text": "GPU has fallen off the bus"}],
                    "throttle_reasons": ["hw_slowdown", "hw_thermal_slowdown"],
                },
                {"index": 1, "available": []},
            ],
        }
    )


def test_the_schema_names_the_health_fields_the_agent_writes(schema):
    assert schema["$defs"]["health_field"]["enum"] == list(FIELDS)
    reading = schema["$defs"]["gpu_health"]["properties"]
    assert set(reading) == {"index", "available", *FIELDS}
    assert reading["throttle_reasons"]["items"]["enum"] == list(THROTTLES)
