"""Realistic heartbeat payloads (a few KB for 8 GPUs), shared by tests and the benchmark."""

from __future__ import annotations

import copy


def gpu_stat(
    index: int, vendor: str = "nvidia", model: str = "NVIDIA H100 80GB HBM3", memory_total_mb: int = 81559, **readings
):
    stat = {
        "index": index,
        "uuid": f"GPU-{index:02d}-5e7c1d2a-90ab-4cde-8f12-3456789abcde",
        "vendor": vendor,
        "model": model,
        "memory_total_mb": memory_total_mb,
        "compute_capability": "9.0",
        "utilization": 37.0 + index,
        "memory_used_mb": 20480 + index,
        "temperature": 55.0 + index,
        "power_w": 310.5 + index,
        "metrics_available": ["utilization", "memory_used_mb", "temperature", "power_w"],
    }
    stat.update(readings)
    return stat


def heartbeat(gpus: int = 8, **overrides) -> dict:
    payload = {
        "hostname": "gpu-node-01",
        "os": "Ubuntu 22.04.4 LTS (Linux 5.15.0-105-generic)",
        "cpu_used": 23.5,
        "memory_used": 41.2,
        "gpu_temperature": 58.0,
        "gpu_memory_used_mb": 163840,
        "docker_available": True,
        "executable": True,
        "exec_mode": "docker",
        "error_message": "",
        "cpu_cores": 128,
        "memory_gb": 1007.5,
        "mac": "3c:ec:ef:12:34:56",
        "internal_ip": "10.20.30.40",
        "is_container": False,
        "agent_version": "2.4.1",
        "agent_git_commit": "9f1c2ab",
        "agent_build_time": "2026-11-20T08:00:00Z",
        "heartbeat_interval": 5,
        "gpu_stats": [gpu_stat(i) for i in range(gpus)],
        "gpu_collect_failures": [],
        "gpu_capabilities": {str(i): {"mig_capable": False, "mps_capable": True, "best_tier": 2} for i in range(gpus)},
        "labels": {"heteroflow.network_zone": "vpc-0a1b2c3d", "topology": "nvlink"},
        "task_health": [],
        "live_task_ids": [],
        "vllm_available": True,
        "inference_engines": ["vllm", "sglang"],
        "inference_engine_versions": {"vllm": "0.11.2", "sglang": "0.5.4"},
        "discovered_models": [
            {
                "name": "Qwen3-32B",
                "path": "/data/heteroflow/model-cache/Qwen3-32B",
                "size_bytes": 65_000_000_000,
                "format": "safetensors",
            }
        ],
    }
    payload.update(copy.deepcopy(overrides))
    return payload
