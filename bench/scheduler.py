"""Scheduler benchmark: N nodes × 8 GPUs and M pending tasks of mixed shapes in a real
PostgreSQL; cycles run (as the 5 s tick would, back to back) until the queue stops
moving. Prints binds per second, time per 200-task cycle (and where it goes: queue,
snapshot, decide, bind, preempt, explain), queries per cycle, and the in-memory decision
time per task (p50/p99) and per 200-task batch.

    make bench-scheduler        (1,000 and 5,000 nodes, 3,000 tasks)
    .venv/bin/python bench/scheduler.py --nodes 1000 --tasks 4000 [--profile]

Uses DATABASE_URL when set, else an embedded PostgreSQL in a scratch folder; works in
its own database heteroflow_bench_sched (dropped before and after; BENCH_KEEP_DB=1 keeps
it for EXPLAIN by hand). --profile prints a cProfile of one cycle, sorted by
BENCH_PROFILE_SORT (default tottime). Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.scratch import scratch_django  # noqa: E402

DB_NAME = "heteroflow_bench_sched"


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1000,5000", help="fleet sizes, comma-separated (one run each)")
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument(
        "--profile", action="store_true", help="also print a cProfile of the first cycle (top 25 by own time)"
    )
    args = parser.parse_args()
    sizes = [int(size) for size in str(args.nodes).split(",") if size.strip()]
    if len(sizes) > 1:  # one process per fleet size, each with a fresh database
        extra = ["--profile"] if args.profile else []
        return max(
            subprocess.call([sys.executable, __file__, "--nodes", str(size), "--tasks", str(args.tasks), *extra])
            for size in sizes
        )
    args.nodes = sizes[0]

    with scratch_django(DB_NAME, "hf-bench-sched-", keep=bool(os.environ.get("BENCH_KEEP_DB"))):
        from django.db import connection, transaction

        from apps.scheduler import core, services
        from apps.scheduler.models import QueueCursor
        from apps.tasks.models import Task
        from apps.tenants.services import create_tenant

        tenants = [create_tenant(name=f"Bench {i}", slug=f"bench-{i}") for i in range(3)]
        with connection.cursor() as cursor:
            cursor.execute(
                """
                INSERT INTO nodes (id, name, status, mac, hostname, os, is_container, docker_available, executable, exec_mode,
                    error_message, agent_version, agent_git_commit, agent_build_time, heartbeat_interval, gpu_type, gpu_model,
                    gpu_count, gpu_collector_error, labels, gpu_capabilities, inference_engines, inference_engine_versions,
                    vllm_available, discovered_models, task_health, live_task_ids, region, zone, rack, structure_hash, version,
                    registered_at, last_heartbeat_at, updated_at, cpu_used, memory_used)
                SELECT 'bn-' || lpad(i::text, 5, '0'), 'bn-' || i, 'online', '', 'h', 'linux', false, true, true, 'docker', '',
                    '2.4.1', 'abc', 'now', 5, 'nvidia', 'H100', 8, '',
                    CASE WHEN i %% 4 = 0 THEN '{"rdma": "true", "rdma-speed": "200"}' ELSE '{}' END::jsonb,
                    '{}', '[]', '{}', false, '[]', '[]', '[]', 'r' || (i %% 2), 'z' || (i %% 6), 'k' || (i %% 40), '', 1,
                    now(), now(), now(), (i * 37) %% 90, (i * 53) %% 90
                FROM generate_series(1, %s) AS i
                """,
                [args.nodes],
            )
            cursor.execute(
                """
                INSERT INTO gpus (node_id, index, uuid, vendor, model, memory_total_mb, compute_capability, metrics_available,
                    absent_streak, absent_basis, present_streak, lost_basis, updated_at, memory_used_mb)
                SELECT n.id, g, '', 'nvidia', 'H100', 81920, '9.0', '[]', 0, 0, 0, '', now(), 1000
                FROM nodes n, generate_series(0, 7) AS g
                """
            )
        shapes = [
            {"gpu_required": 1},
            {"gpu_required": 2},
            {"gpu_required": 4},
            {"gpu_required": 8},
            {"gpu_required": 0, "gpu_memory_mb": 20000},
            {"gpu_required": 1, "labels": {"rdma": "required"}},
            {"gpu_required": 2, "labels": {"region": "r1", "zone": "z3"}},
            {"gpu_required": 1, "gpu_type": "nvidia"},
        ]
        Task.objects.bulk_create(
            Task(tenant=tenants[i % 3], name=f"b{i}", image="x", priority=(i * 7) % 101, **shapes[i % len(shapes)])
            for i in range(args.tasks)
        )
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")  # as autovacuum would have by then: plans for the real row counts
        print(
            f"{args.nodes} nodes × 8 GPUs, {args.tasks} pending tasks in {len(shapes)} shapes; machine: {os.cpu_count()} cores",
            flush=True,
        )

        # the in-memory decision alone: one 200-task batch on a fresh snapshot, five times
        batch = services.next_batch()
        QueueCursor.objects.all().delete()  # the measured run below starts at the head of the queue
        decide_times, per_task = [], []
        for _ in range(5):
            snapshot = services.load_nodes()
            marks: list[float] = []
            started = time.perf_counter()
            core.place(
                batch,
                snapshot,
                services.plugin_settings(),
                lambda a, b: a == b,
                mark=lambda: marks.append(time.perf_counter()),
            )
            decide_times.append(time.perf_counter() - started)
            per_task += [later - earlier for earlier, later in zip(marks, marks[1:])]

        cycles, total_bound, cycle_times, queries = 0, 0, [], []
        started_all = time.perf_counter()
        idle = 0
        phases: list[dict] = []
        all_bound: list[int] = []
        counter = {"n": 0}

        def count(execute, sql, params, many, context):
            counter["n"] += 1
            return execute(sql, params, many, context)

        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            with transaction.atomic():  # rolled back: the measured run below starts from the same queue
                profiler.runcall(services.run_cycle)
                transaction.set_rollback(True)
            pstats.Stats(profiler).sort_stats(os.environ.get("BENCH_PROFILE_SORT", "tottime")).print_stats(25)

        while idle < 2:
            counter["n"] = 0
            with connection.execute_wrapper(count):
                started = time.perf_counter()
                result = services.run_cycle()
                cycle_times.append(time.perf_counter() - started)
            queries.append(counter["n"])
            cycles += 1
            if result.bound:
                phases.append(result.phases)
            total_bound += len(result.bound)
            all_bound.append(len(result.bound))
            idle = idle + 1 if not result.bound else 0
        elapsed = time.perf_counter() - started_all
        binding = [t for t, p in zip(cycle_times, all_bound) if p]
        full = cycle_times
        print(
            f"  cycles                {cycles} ({total_bound} binds in {elapsed:.1f} s = {total_bound / elapsed:.0f} binds/s, "
            f"counting the cycles that found nothing more to place)"
        )
        print(
            f"  sustained             {total_bound / sum(binding):.0f} binds/s over the {len(binding)} cycles that bound"
        )
        print(f"  time per 200-task cycle  p50 {percentile(full, 0.5) * 1000:.0f} ms, max {max(full) * 1000:.0f} ms")
        print(
            f"  queries per cycle     p50 {percentile(queries, 0.5):.0f}, max {max(queries)} (the binds of a cycle are one transaction)"
        )
        if phases:
            split = ", ".join(
                f"{name} {percentile([p.get(name, 0) for p in phases], 0.5) * 1000:.0f}" for name in phases[0]
            )
            print(f"  where a binding cycle's time goes (p50, ms)  {split}")
        print(
            f"  decision time per task  p50 {percentile(per_task, 0.5) * 1000:.2f} ms, p99 {percentile(per_task, 0.99) * 1000:.2f} ms"
            f" (in memory, {len(per_task)} decisions)"
        )
        best = min(decide_times)
        print(
            f"  in-memory decisions for 200 tasks on {args.nodes} nodes  {best * 1000:.0f} ms ({best / len(batch) * 1000:.2f} ms per task; worst of 5 runs {max(decide_times) * 1000:.0f} ms)"
        )
        return 0


if __name__ == "__main__":
    sys.exit(main())
