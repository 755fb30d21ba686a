"""`hf usage`: the tasks' GPU time and the endpoint keys' usage per key and model, with
the GPU-seconds the gateway metered (the requests' shares of their replicas' cards)."""

from __future__ import annotations

from hf_fakeapi import Answer

STATS = {"total": 3, "by_status": {"running": 1, "succeeded": 2}, "gpus_held": 2, "gpu_seconds_settled": 7200}
TOTALS = [
    {"key": 1, "key_name": "app", "model": "qwen", "requests": 12, "errors": 1, "prompt_tokens": 80,
     "completion_tokens": 40, "gpu_seconds": 3.456, "minutes": 2},
    {"key": 2, "key_name": None, "model": "llama", "requests": 1, "errors": 0, "prompt_tokens": 3,
     "completion_tokens": 1, "gpu_seconds": None, "minutes": 1},
]  # fmt: skip


def test_usage_prints_the_tasks_and_each_key_and_models_gpu_seconds(hf, fakeapi):
    fakeapi.route("GET", r"/api/v1/tasks/stats", lambda r, m: Answer(200, STATS))
    fakeapi.route(
        "GET",
        r"/api/v1/gateway/usage",
        lambda r, m: Answer(200, {"count": 0, "next": None, "previous": None, "results": [], "totals": TOTALS}),
    )
    code, out, err = hf("usage", "--model", "qwen")
    assert code == 0, err
    assert "2.00 GPU-hours settled" in out
    lines = out.strip().splitlines()
    header, first, second = lines[1], lines[-2], lines[-1]
    assert header.split()[-1] == "GPU-SECONDS"
    assert first.split()[0] == "app" and first.split()[-1] == "3.46"
    assert second.split()[-1] == "0.00"  # none reported (an older server): nothing metered
    assert fakeapi.got("GET", "/api/v1/gateway/usage")[-1].query["model"] == "qwen"
