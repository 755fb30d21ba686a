"""Scheduler benchmark: N nodes × 8 GPUs and M pending tasks of mixed shapes in a real
PostgreSQL; cycles run (as the 5 s tick would, back to back) until the queue stops
moving. Prints binds per second, time per 200-task cycle (and where it goes: queue,
snapshot, decide, bind, preempt, explain), queries per cycle, and the in-memory decision
time per task (p50/p99) and per 200-task batch.

    make bench-scheduler        (1,000 and 5,000 nodes, 3,000 tasks; then the group scenario)
    .venv/bin/python bench/scheduler.py --nodes 1000 --tasks 4000 [--profile]
    .venv/bin/python bench/scheduler.py --nodes 1000 --groups 50

The group scenario (--groups N, issue 15): N task groups of 4 to 32 workers among the
single tasks, placed all-or-nothing by the same cycles; it prints each group placement's
decision time (p50/p99, the pure core's place_group as the cycles called it), the 32-worker
groups' against the 50 ms target, and the binds/s with the groups in the queue.

Uses DATABASE_URL when set, else an embedded PostgreSQL in a scratch folder; works in
its own database heteroflow_bench_sched (dropped before and after; BENCH_KEEP_DB=1 keeps
it for EXPLAIN by hand). --profile prints a cProfile of one cycle, sorted by
BENCH_PROFILE_SORT (default tottime). Asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.scratch import scratch_django  # noqa: E402

DB_NAME = "heteroflow_bench_sched"


DEFAULT_GROUPS, GROUP_FLEET = 50, 1000  # issue 15's scenario: 50 groups on 1,000 nodes × 8 GPUs
GROUP_SIZES = (4, 8, 16, 24, 32)  # workers, in turn
GROUP_CARDS = (8, 2, 4, 1)  # cards per worker, in turn


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1000,5000", help="fleet sizes, comma-separated (one run each)")
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--statements", action="store_true", help="also print the SQL statements by time per cycle")
    parser.add_argument(
        "--decide-runs", type=int, default=5, help="runs of the in-memory 200-task decision (the best is printed)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also print a cProfile of the first cycle (top 25 by own time)"
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=None,
        help="task groups among the tasks (the group scenario); default: with several fleet sizes, one more run "
        f"with {DEFAULT_GROUPS} groups on {GROUP_FLEET} nodes after the single-task runs, else none",
    )
    parser.add_argument("--tenants", type=int, default=3, help="tenants the tasks belong to, in turn")
    parser.add_argument(
        "--queues",
        choices=("off", "on"),
        default="off",
        help="on: every tenant has a queue (docs/queues.md): 5 cohorts, weights 1-3, the fleet's cards "
        "split evenly as nominal",
    )
    parser.add_argument(
        "--fair-share",
        action="store_true",
        help=f"the fair-share scenario alone: {FAIR_NODES} nodes, {FAIR_TASKS} tasks of {FAIR_TENANTS} tenants, "
        "run with queues off, then on",
    )
    args = parser.parse_args()
    if args.fair_share:
        return fair_share_runs(args)
    sizes = [int(size) for size in str(args.nodes).split(",") if size.strip()]
    if len(sizes) > 1:  # one process per run, each with a fresh database
        extra = ["--profile"] if args.profile else []
        runs = [[*sizes_args, "--groups", "0"] for sizes_args in (["--nodes", str(size)] for size in sizes)]
        if args.groups is None:
            runs.append(["--nodes", str(GROUP_FLEET), "--groups", str(DEFAULT_GROUPS)])
            runs += [fair_share_run(queues) for queues in ("off", "on")]
        elif args.groups:
            runs = [[*run[:2], "--groups", str(args.groups)] for run in runs]
        command = [sys.executable, __file__, "--tasks", str(args.tasks), *extra]
        return max(subprocess.call([*command, *run]) for run in runs)
    args.nodes = sizes[0]
    args.groups = args.groups or 0

    with scratch_django(DB_NAME, "hf-bench-sched-", keep=bool(os.environ.get("BENCH_KEEP_DB"))):
        from django.db import connection, transaction

        from apps.scheduler import core, services
        from apps.scheduler.core import placement
        from apps.scheduler.models import QueueCursor
        from apps.scheduler.snapshot import GpuRowCache
        from apps.tasks.models import Task
        from apps.tenants.services import create_tenant

        tenants = [create_tenant(name=f"Bench {i}", slug=f"bench-{i}") for i in range(args.tenants)]
        if args.queues == "on":
            from apps.scheduler import quotas

            nominal = args.nodes * 8 // len(tenants)
            for i, tenant in enumerate(tenants):
                quotas.set_queue(
                    tenant, cohort=f"c{i % 5}", weight=float(1 + i % 3), quotas=[quotas.QuotaInput("nvidia", nominal)]
                )
        with connection.cursor() as cursor:
            cursor.execute(
                (
                    "\n"
                    "                INSERT INTO nodes (id, name, status, mac, hostname, os, is_container, "
                    "docker_available, executable, exec_mode,\n"
                    "                    error_message, agent_version, agent_git_commit, agent_build_time, "
                    "heartbeat_interval, gpu_type, gpu_model,\n"
                    "                    gpu_count, gpu_collector_error, labels, gpu_capabilities, inference_engines, "
                    "inference_engine_versions,\n"
                    "                    vllm_available, discovered_models, task_health, live_task_ids, region, zone, "
                    "rack, structure_hash, version,\n"
                    "                    registered_at, last_heartbeat_at, updated_at, cpu_used, memory_used,\n"
                    "                    agent_label_keys)\n"
                    "                SELECT 'bn-' || lpad(i::text, 5, '0'), 'bn-' || i, 'online', '', 'h', 'linux', "
                    "false, true, true, 'docker', '',\n"
                    "                    '2.4.1', 'abc', 'now', 5, 'nvidia', 'H100', 8, '',\n"
                    '                    CASE WHEN i %% 4 = 0 THEN \'{"rdma": "true", '
                    '"rdma-speed": "200"}\' ELSE \'{}\' END::jsonb,\n'
                    "                    '{}', '[]', '{}', false, '[]', '[]', '[]', 'r' || (i %% 2), 'z' || (i %% 6), "
                    "'k' || (i %% 40), '', 1,\n"
                    "                    now(), now(), now(), (i * 37) %% 90, (i * 53) %% 90, '[]'\n"
                    "                FROM generate_series(1, %s) AS i\n"
                    "                "
                ),
                [args.nodes],
            )
            cursor.execute(
                "\n"
                "                INSERT INTO gpus (node_id, index, uuid, vendor, model, memory_total_mb, "
                "compute_capability, metrics_available,\n"
                "                    absent_streak, absent_basis, present_streak, lost_basis, updated_at, "
                "memory_used_mb)\n"
                "                SELECT n.id, g, '', 'nvidia', 'H100', 81920, '9.0', '[]', 0, 0, 0, '', now(), "
                "1000\n"
                "                FROM nodes n, generate_series(0, 7) AS g\n"
                "                "
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
            Task(
                tenant=tenants[i % len(tenants)],
                name=f"b{i}",
                image="x",
                priority=(i * 7) % 101,
                **shapes[i % len(shapes)],
            )
            for i in range(args.tasks)
        )
        groups = add_groups(tenants, args.groups)
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")  # as autovacuum would have by then: plans for the real row counts
        among = (
            f", {len(groups)} task groups of {min(GROUP_SIZES)}-{max(GROUP_SIZES)} workers "
            f"({sum(g.world_size for g in groups)} workers) among them"
            if groups
            else ""
        )
        queues = (
            f"; {len(tenants)} tenants, queues {args.queues}"
            + (" (5 cohorts, weights 1-3, the cards split evenly as nominal)" if args.queues == "on" else "")
            if args.tenants != 3 or args.queues == "on"
            else ""
        )
        print(
            f"{args.nodes} nodes × 8 GPUs, {args.tasks} pending tasks in {len(shapes)} shapes{among}{queues}; "
            f"machine: {os.cpu_count()} cores",
            flush=True,
        )

        # the in-memory decision alone: one 200-task batch on a fresh snapshot, --decide-runs
        # times (the best is the figure least disturbed by whatever else the machine runs)
        batch = services.next_batch()
        QueueCursor.objects.all().delete()  # the measured run below starts at the head of the queue
        decide_times, per_task = [], []
        for _ in range(args.decide_runs):
            snapshot = services.load_nodes()
            marks: list[float] = []
            gc.disable()  # as run_cycle decides: the collector off for the cycle
            started = time.perf_counter()
            core.place(
                batch,
                snapshot,
                services.plugin_settings(),
                lambda a, b: a == b,
                mark=lambda marks=marks: marks.append(time.perf_counter()),
            )
            decide_times.append(time.perf_counter() - started)
            gc.enable()
            per_task += [later - earlier for earlier, later in zip(marks, marks[1:], strict=False)]

        cycles, total_bound, cycle_times, queries = 0, 0, [], []
        started_all = time.perf_counter()
        idle = 0
        phases: list[dict] = []
        all_bound: list[int] = []
        counter = {"n": 0}

        statement_ms: dict[str, float] = {}  # --statements: each statement's time, summed over the cycles

        def count(execute, sql, params, many, context):
            counter["n"] += 1
            if not args.statements:
                return execute(sql, params, many, context)
            started = time.perf_counter()
            try:
                return execute(sql, params, many, context)
            finally:
                key = " ".join(sql.split())[:90]
                statement_ms[key] = statement_ms.get(key, 0.0) + (time.perf_counter() - started) * 1000

        gpu_rows = GpuRowCache()  # kept between the cycles, as the tick keeps it
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            with transaction.atomic():  # rolled back: the measured run below starts from the same queue
                profiler.runcall(services.run_cycle, gpu_rows=gpu_rows)
                transaction.set_rollback(True)
            pstats.Stats(profiler).sort_stats(os.environ.get("BENCH_PROFILE_SORT", "tottime")).print_stats(25)

        group_times: dict[int, list[float]] = {}  # workers -> each group placement's decision time (ms)
        if groups:
            timed_group = placement.place_group

            def place_group(group, fleet):  # core.place_queue's own call, timed
                started = time.perf_counter()
                outcome = timed_group(group, fleet)
                group_times.setdefault(group.world_size, []).append((time.perf_counter() - started) * 1000)
                return outcome

            placement.place_group = place_group
        groups_bound = 0
        while idle < 2:
            counter["n"] = 0
            with connection.execute_wrapper(count):
                started = time.perf_counter()
                result = services.run_cycle(gpu_rows=gpu_rows)
                cycle_times.append(time.perf_counter() - started)
            queries.append(counter["n"])
            cycles += 1
            if result.bound:
                phases.append(result.phases)
            total_bound += len(result.bound)
            groups_bound += len(getattr(result, "groups_bound", ()))
            all_bound.append(len(result.bound))
            idle = idle + 1 if not result.bound else 0
        elapsed = time.perf_counter() - started_all
        binding = [t for t, p in zip(cycle_times, all_bound, strict=True) if p]
        full = cycle_times
        print(
            f"  cycles                {cycles} ({total_bound} binds in {elapsed:.1f} s = "
            f"{total_bound / elapsed:.0f} binds/s, "
            f"counting the cycles that found nothing more to place)"
        )
        print(
            f"  sustained             {total_bound / sum(binding):.0f} binds/s "
            f"over the {len(binding)} cycles that bound"
        )
        print(f"  time per 200-task cycle  p50 {percentile(full, 0.5) * 1000:.0f} ms, max {max(full) * 1000:.0f} ms")
        print(
            f"  queries per cycle     p50 {percentile(queries, 0.5):.0f}, max {max(queries)} "
            f"(the binds of a cycle are one transaction)"
        )
        if statement_ms:
            print(f"  statements by time, per cycle (ms, over {cycles} cycles)")
            for key, total in sorted(statement_ms.items(), key=lambda item: -item[1])[:12]:
                print(f"    {total / cycles:7.2f}  {key}")
        if phases:
            split = ", ".join(
                f"{name} {percentile([p.get(name, 0) for p in phases], 0.5) * 1000:.0f}" for name in phases[0]
            )
            print(f"  where a binding cycle's time goes (p50, ms)  {split}")
        print(
            f"  decision time per task  p50 {percentile(per_task, 0.5) * 1000:.2f} ms, "
            f"p99 {percentile(per_task, 0.99) * 1000:.2f} ms"
            f" (in memory, {len(per_task)} decisions)"
        )
        best = min(decide_times)
        print(
            f"  in-memory decisions for 200 tasks on {args.nodes} nodes  {best * 1000:.0f} ms "
            f"({best / len(batch) * 1000:.2f} ms per task; "
            f"median of {len(decide_times)} runs {statistics.median(decide_times) * 1000:.0f} ms)"
        )
        if groups:
            placement.place_group = timed_group
            report_groups(groups, groups_bound, group_times, services, core)
        return 0


FAIR_NODES, FAIR_TASKS, FAIR_TENANTS = 1000, 10_000, 50  # issue 33's scenario


def fair_share_run(queues: str) -> list[str]:
    return [
        "--nodes",
        str(FAIR_NODES),
        "--tasks",
        str(FAIR_TASKS),
        "--tenants",
        str(FAIR_TENANTS),
        "--queues",
        queues,
        "--groups",
        "0",
    ]


def fair_share_runs(args) -> int:
    """The fair-share scenario, queues off then on, each in its own process and database."""
    extra = ["--profile"] if args.profile else []
    return max(subprocess.call([sys.executable, __file__, *extra, *fair_share_run(queues)]) for queues in ("off", "on"))


def add_groups(tenants, count: int) -> list:
    """`count` pending task groups (GROUP_SIZES workers × GROUP_CARDS cards in turn, ddp
    and pp in turn, priorities spread over the singles'), as a submission leaves them."""
    if not count:
        return []
    from apps.tasks.models import Task, TaskGroup

    groups = TaskGroup.objects.bulk_create(
        TaskGroup(
            tenant=tenants[i % 3],
            name=f"g{i}",
            world_size=GROUP_SIZES[i % len(GROUP_SIZES)],
            gpus_per_worker=GROUP_CARDS[i % len(GROUP_CARDS)],
            gpu_type="nvidia",
            strategy=("ddp", "pp")[i % 2],
            image="x",
            priority=(i * 13) % 101,
        )
        for i in range(count)
    )
    Task.objects.bulk_create(
        Task(
            tenant=group.tenant,
            name=f"{group.name}-{rank}",
            image="x",
            kind="training",
            group=group,
            rank=rank,
            gpu_required=group.gpus_per_worker,
            gpu_type=group.gpu_type,
            priority=group.priority,
        )
        for group in groups
        for rank in range(group.world_size)
    )
    return groups


def report_groups(groups, groups_bound: int, group_times: dict[int, list[float]], services, core) -> None:
    """The group lines: decision time per placement as the cycles ran them, and a
    32-worker group placed on fresh snapshots of the emptied fleet (bench/gang.py's
    timing) against the target."""
    from bench.gang import summary, time_group, verdict

    every = sorted(t for times in group_times.values() for t in times)
    print(f"  groups                {groups_bound} of {len(groups)} bound whole ({len(every)} placements decided)")
    if every:
        print(f"  group decision time   {summary(every)} (in the cycles, fleet filling up)")
    for workers in sorted(group_times):
        times = sorted(group_times[workers])
        target = f" ({verdict(times)})" if workers == 32 else ""
        print(f"    {workers:>2} workers         {summary(times)}{target}")
    from apps.scheduler.models import GpuAllocation

    GpuAllocation.objects.all().delete()  # an empty fleet again: every 32-worker group fits
    settings, may_share = services.plugin_settings(), services.sharing_rule()
    for per_worker in (8, 2):
        views = (core.FleetView(services.load_nodes(), settings, may_share) for _ in range(10))
        times = time_group(views, 32, per_worker, "ddp")
        print(f"  32 workers × {per_worker} cards on the fleet  {summary(times)} ({verdict(times)})")


if __name__ == "__main__":
    sys.exit(main())
