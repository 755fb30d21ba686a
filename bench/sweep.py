"""Alert sweep benchmark: how its cost grows with the fleet. For each fleet size N: N
nodes × 8 GPUs with a running task each, plus 10 healthy nodes, in a real PostgreSQL.

- steady: every node beating; the sweep finds nothing to do;
- mass failure: the N nodes went silent at once (a rack, a network split); one sweep
  raises N NODE_OFFLINE and N TASK_REQUEUED alerts and requeues the N tasks;
- after: the next sweep, with nothing left to move.

    make bench-sweep
    .venv/bin/python bench/sweep.py --nodes 250,500,1000,2000,4000

Uses DATABASE_URL when set, else an embedded PostgreSQL in a scratch folder; works in its
own database heteroflow_bench_sweep (dropped before and after). Prints figures; asserts
nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.scratch import scratch_django  # noqa: E402

DB_NAME = "heteroflow_bench_sweep"
HEALTHY = 10


def seed(size: int, tenant) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE alerts, task_events, usage_records, gpu_allocations, tasks, gpus, nodes CASCADE")
        cursor.execute(
            (
                "\n"
                "            INSERT INTO nodes (id, name, status, mac, hostname, os, is_container, docker_available, "
                "executable, exec_mode,\n"
                "                error_message, agent_version, agent_git_commit, agent_build_time, heartbeat_interval, "
                "gpu_type, gpu_model,\n"
                "                gpu_count, gpu_collector_error, labels, gpu_capabilities, inference_engines, "
                "inference_engine_versions,\n"
                "                vllm_available, discovered_models, task_health, region, zone, rack, structure_hash, "
                "version,\n"
                "                registered_at, last_heartbeat_at, updated_at, agent_label_keys)\n"
                "            SELECT 'sw-' || lpad(i::text, 5, '0'), 'sw-' || i, 'online', '', 'h', 'linux', false, "
                "true, true, 'docker', '',\n"
                "                '2.4.1', 'abc', 'now', 5, 'nvidia', 'H100', 8, '', '{}', '{}', '[]', '{}', false, "
                "'[]', '[]', '', '', '', '',\n"
                "                1, now(), now(), now(), '[]'\n"
                "            FROM generate_series(1, %s) AS i\n"
                "            "
            ),
            [size + HEALTHY],
        )
        cursor.execute(
            "\n"
            "            INSERT INTO gpus (node_id, index, uuid, vendor, model, memory_total_mb, "
            "compute_capability, metrics_available,\n"
            "                absent_streak, absent_basis, present_streak, lost_basis, updated_at)\n"
            "            SELECT n.id, g, '', 'nvidia', 'H100', 81920, '9.0', '[]', 0, 0, 0, '', now()\n"
            "            FROM nodes n, generate_series(0, 7) AS g\n"
            "            "
        )
        cursor.execute(
            (
                "\n"
                "            INSERT INTO tasks (tenant_id, name, kind, status, image, command, env, volumes, ports, "
                "gpu_required, gpu_type,\n"
                "                priority, preemptible, labels, timeout_seconds, checkpoint_path, "
                "resume_from_checkpoint, node_id,\n"
                "                preempt_count, error_message, log_tail, schedule_reason, created_at, updated_at, "
                "started_at, running_since,\n"
                "                gpu_seconds, serving)\n"
                "            SELECT %s, 'job-' || n.id, 'job', 'running', 'x', '[]', '{}', '[]', '[]', 1, '', 50, "
                "false, '{}', 7200, '', '',\n"
                "                n.id, 0, '', '', '{}', now() - interval '1 hour', now() - interval '1 hour', "
                "now() - interval '1 hour',\n"
                "                now() - interval '1 hour', 0, '{}'\n"
                "            FROM nodes n WHERE n.id <= 'sw-' || lpad(%s::text, 5, '0')\n"
                "            "
            ),
            [tenant.pk, size],
        )
        cursor.execute(
            """INSERT INTO gpu_allocations (task_id, node_id, gpu_index, tenant_id, created_at)
               SELECT t.id, t.node_id, 0, t.tenant_id, now() FROM tasks t"""
        )
        cursor.execute("ANALYZE")


def timed(work):
    from django.db import connection

    counter = {"n": 0}

    def count(execute, sql, params, many, context):
        counter["n"] += 1
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count):
        started = time.perf_counter()
        result = work()
        return result, time.perf_counter() - started, counter["n"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="250,500,1000,2000,4000", help="fleet sizes that fail, comma-separated")
    args = parser.parse_args()
    sizes = [int(size) for size in args.nodes.split(",") if size.strip()]
    with scratch_django(DB_NAME, "hf-bench-sweep-"):
        from datetime import timedelta

        from django.db import connection

        from apps.alerts.failures import sweep
        from apps.core.clock import utcnow
        from apps.tenants.services import create_tenant

        tenant = create_tenant(name="Bench", slug="bench")
        print(
            f"alert sweep: N failing nodes × 8 GPUs with a running task each, plus {HEALTHY} healthy; "
            f"machine: {os.cpu_count()} cores",
            flush=True,
        )
        print(f"{'N':>6} {'steady ms':>10} {'mass failure ms':>16} {'µs per node':>12} {'queries':>8} {'after ms':>9}")
        for size in sizes:
            seed(size, tenant)
            _, steady, _ = timed(sweep)
            with connection.cursor() as cursor:  # the rack goes silent
                cursor.execute(
                    "UPDATE nodes SET last_heartbeat_at = now() - interval '60 seconds' WHERE id <= %s",
                    [f"sw-{size:05d}"],
                )
            result, mass, queries = timed(sweep)
            assert len(result.requeued) == size and len(result.offline) == size, (
                len(result.requeued),
                len(result.offline),
            )
            _, after, _ = timed(lambda: sweep(utcnow() + timedelta(seconds=1)))
            print(
                f"{size:>6} {steady * 1000:>10.1f} {mass * 1000:>16.1f} {mass / size * 1e6:>12.0f} {queries:>8} "
                f"{after * 1000:>9.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
