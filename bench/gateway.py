"""Gateway benchmark: the OpenAI-compatible gateway and, in the same run, LiteLLM's proxy,
both in front of one fast local OpenAI-compatible upstream (the tests' stand-in,
tests/gateway/upstream.py, under uvicorn), under the same load generator.

For each of direct (the upstream alone), the gateway and LiteLLM (when its `litellm`
command is found: --litellm, else PATH):
- added latency: p50 and p99 of non-streaming chat completions at a fixed open-loop rate
  (--rate, default 200/s) minus the upstream's own;
- time to first byte of a streaming chat completion (sequential, p50);
- the highest rate sustained with p99 under 100 ms and no errors (rates stepped up).

    make bench-gateway
    .venv/bin/python bench/gateway.py --duration 3 --workers 1 --litellm /path/to/litellm

Both servers get --workers processes. The load generator is Python (aiohttp) on the
same machine, so on a small machine it takes CPU from the servers it measures: the
figures are a floor. Uses DATABASE_URL / REDIS_URL when set, else the embedded pair;
works in a database of its own, heteroflow_bench_gateway, dropped before and after.
Prints figures and, for each target, PASS or FAIL (the exit status stays 0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.heartbeats import (  # noqa: E402
    drop_database,
    free_port,
    percentile,
    recreate_database,
    server_env,
    start_server,
    stores_in_use,
    wait_for,
)
from heteroflow.embedded import ensure_data_stores  # noqa: E402

DB_NAME = "heteroflow_bench_gateway"
MODEL = "bench-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
RATES = (10, 25, 50, 100, 200, 400, 600, 800, 1000, 1200, 1500, 2000, 2500, 3000)
ADDED_P50_TARGET, ADDED_P99_TARGET, RATE_TARGET, LITELLM_FACTOR = 2.0, 10.0, 1000, 10

SETUP = r"""
import sys, django
django.setup()
from apps.core.principals import Principal, PrincipalKind
from apps.gateway import services as gateway
from apps.inference.models import InferenceService, Model
from apps.nodes.models import Node
from apps.tasks.models import Task, TaskGroup
from apps.tenants import services
from django.contrib.auth import get_user_model
from apps.core.clock import utcnow

port, model = int(sys.argv[1]), sys.argv[2]
tenant = services.create_tenant(name="Bench", slug="bench")
user = get_user_model().objects.create_user(username="bench-member")
services.add_member(tenant, username=user.username, role="member")
principal = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role="member")
registered = Model.objects.create(tenant=tenant, name=model, source_kind="path", source="/m", format="gguf")
group = TaskGroup.objects.create(tenant=tenant, name=model, kind="inference", placement="replicas", world_size=1,
                                 gpus_per_worker=1, gpu_type="nvidia", image="auto")
InferenceService.objects.create(group=group, model=registered, state="running")
node = Node.objects.create(id="bench-node", name="bench-node", ip="127.0.0.1", last_heartbeat_at=utcnow())
task = Task.objects.create(tenant=tenant, name="replica-0", image="x", kind="inference", group=group, rank=0,
                           status="running", node=node, host_port=port, gpu_required=1)
node.task_health = [{"task_id": task.pk, "healthy": True}]
node.save(update_fields=["task_health"])
print(gateway.create_key(principal, tenant=tenant, name="bench").key)
"""

LITELLM_CONFIG = """model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: http://127.0.0.1:{port}/v1
      api_key: none
general_settings:
  master_key: {key}
"""


def say(message: str) -> None:
    print(message, flush=True)


def upstream_app():
    """uvicorn --factory bench.gateway:upstream_app"""
    from tests.gateway.upstream import Upstream

    return Upstream("bench")


async def open_loop(url: str, headers: dict, rate: float, duration: float) -> tuple[list[float], int, float]:
    """Requests started at `rate` per second for `duration` s whatever the answers:
    (latencies in s, errors, the rate achieved)."""
    import aiohttp

    latencies, errors = [], 0
    total = max(1, int(rate * duration))
    connector = aiohttp.TCPConnector(limit=1024)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def one():
            nonlocal errors
            started = time.perf_counter()
            try:
                async with session.post(url, json=BODY) as response:
                    await response.read()
                    if response.status != 200:
                        errors += 1
                        return
            except aiohttp.ClientError:
                errors += 1
                return
            latencies.append(time.perf_counter() - started)

        tasks = []
        begin = time.perf_counter()
        for i in range(total):
            delay = begin + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - begin
    return latencies, errors, total / elapsed


async def first_bytes(url: str, headers: dict, count: int = 50) -> list[float]:
    import aiohttp

    found = []
    async with aiohttp.ClientSession(headers=headers) as session:
        for _ in range(count):
            started = time.perf_counter()
            async with session.post(url, json=BODY | {"stream": True}) as response:
                await response.content.readany()
                found.append(time.perf_counter() - started)
                await response.read()
    return found


def measure(name: str, base: str, headers: dict, args) -> dict:
    url = f"{base}/v1/chat/completions"
    asyncio.run(open_loop(url, headers, 50, 1))  # warm up: connections, caches
    latencies, errors, _ = asyncio.run(open_loop(url, headers, args.rate, args.duration))
    result = {
        "p50": percentile(latencies, 0.5) * 1000 if latencies else float("nan"),
        "p99": percentile(latencies, 0.99) * 1000 if latencies else float("nan"),
        "errors": errors,
        "ttfb": percentile(asyncio.run(first_bytes(url, headers)), 0.5) * 1000,
        "sustained": 0,
    }
    for rate in RATES:
        latencies, errors, achieved = asyncio.run(open_loop(url, headers, rate, args.duration))
        p99 = percentile(latencies, 0.99) * 1000 if latencies else float("inf")
        ok = not errors and p99 < 100 and achieved >= 0.95 * rate
        say(
            f"  {name:8} {rate:5}/s: p99 {p99:7.1f} ms, errors {errors}, "
            f"achieved {achieved:6.0f}/s {'ok' if ok else ''}"
        )
        if not ok:
            break
        result["sustained"] = rate
    return result


def verdict(label: str, value: float, target: float, unit: str, *, at_most: bool = False) -> str:
    passed = value <= target if at_most else value >= target
    sign = "<=" if at_most else ">="
    return f"  {'PASS' if passed else 'FAIL'}  {label}: {value:.1f}{unit} (target {sign} {target}{unit})"


def litellm_env() -> dict:
    """LiteLLM's proxy with its defaults: no database (it would take DATABASE_URL for its
    own, through prisma), no Redis, and its model cost map from the package (there is no
    network to fetch it: three slow retries)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "REDIS_HOST")}
    return env | {"LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def find_litellm(given: str | None) -> str | None:
    if given:
        return given
    return shutil.which("litellm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=200.0, help="the fixed rate for the added latency")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds at each rate")
    parser.add_argument("--workers", type=int, default=1, help="processes of each server")
    parser.add_argument("--litellm", help="the litellm command (litellm[proxy] installed); default: from PATH")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="hf-bench-gateway-"))
    (scratch / "static").mkdir()
    stores = ensure_data_stores(scratch, os.environ)
    database_url = recreate_database(stores.database_url, DB_NAME)
    env = server_env(database_url, stores.redis_url, scratch, secrets.token_urlsafe(24))
    processes = []
    try:
        up_port = free_port()
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "--factory",
                    "bench.gateway:upstream_app",
                    "--port",
                    str(up_port),
                    "--workers",
                    str(args.workers),
                    "--log-level",
                    "critical",
                    "--no-access-log",
                    "--lifespan",
                    "off",
                ],
                cwd=REPO,
                env=env,
                start_new_session=True,
            )
        )
        subprocess.run(
            [sys.executable, "manage.py", "migrate_schemas", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True
        )
        key = (
            subprocess.run(
                [sys.executable, "-c", SETUP, str(up_port), MODEL],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        wait_for(f"http://127.0.0.1:{up_port}/v1/models")
        server, gw_port = start_server(env, args.workers)
        processes.append(server)
        targets = [
            ("direct", f"http://127.0.0.1:{up_port}", {}),
            ("gateway", f"http://127.0.0.1:{gw_port}", {"Authorization": f"Bearer {key}"}),
        ]
        litellm = find_litellm(args.litellm)
        if litellm:
            ll_port, master = free_port(), "sk-bench-" + secrets.token_hex(8)
            config = scratch / "litellm.yaml"
            config.write_text(LITELLM_CONFIG.format(model=MODEL, port=up_port, key=master))
            processes.append(
                subprocess.Popen(
                    [litellm, "--config", str(config), "--port", str(ll_port), "--num_workers", str(args.workers)],
                    cwd=scratch,
                    env=litellm_env(),
                    start_new_session=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            wait_for(f"http://127.0.0.1:{ll_port}/health/liveliness", timeout=180)
            targets.append(("litellm", f"http://127.0.0.1:{ll_port}", {"Authorization": f"Bearer {master}"}))
        say(
            f"upstream: the stand-in under uvicorn; gateway: uvicorn, production settings; {args.workers} process(es) "
            f"each; data stores: {stores_in_use(stores)}; machine: {os.cpu_count()} cores; "
            f"LiteLLM: {litellm or 'not found (pass --litellm)'}"
        )
        results = {}
        for name, base, headers in targets:
            say(f"\n== {name} ==")
            results[name] = measure(name, base, headers, args)
        direct = results["direct"]
        say(f"\n{'':8} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} {'ttfb ms':>8} {'max rate':>9}")
        for name, r in results.items():
            added = (r["p50"] - direct["p50"], r["p99"] - direct["p99"]) if name != "direct" else (0.0, 0.0)
            say(
                f"{name:8} {r['p50']:8.2f} {r['p99']:8.2f} {added[0]:10.2f} {added[1]:10.2f} {r['ttfb']:8.2f} "
                f"{r['sustained']:8}/s"
            )
        gateway = results["gateway"]
        say("")
        say(
            verdict(
                f"gateway added p50 at {args.rate:.0f}/s",
                gateway["p50"] - direct["p50"],
                ADDED_P50_TARGET,
                " ms",
                at_most=True,
            )
        )
        say(
            verdict(
                f"gateway added p99 at {args.rate:.0f}/s",
                gateway["p99"] - direct["p99"],
                ADDED_P99_TARGET,
                " ms",
                at_most=True,
            )
        )
        say(verdict("gateway rate with p99 < 100 ms", gateway["sustained"], RATE_TARGET, "/s"))
        if "litellm" in results:
            ratio = gateway["sustained"] / max(results["litellm"]["sustained"], 1)
            say(verdict("gateway rate / LiteLLM's", ratio, LITELLM_FACTOR, "x"))
        return 0
    finally:
        for process in reversed(processes):
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        drop_database(stores.database_url, DB_NAME)
        stores.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
