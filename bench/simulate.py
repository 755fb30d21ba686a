"""The simulator's speed (docs/simulate.md#speed): a generated trace replayed on a
described fleet through the pure core (no database), under binpack and spread; prints
for each the wall time, the cycles, the jobs placed and the figures. Issue 34's target:
one simulated week of 1,000 nodes × 8 cards with 100,000 jobs in at most 120 s. Asserts
nothing.

    .venv/bin/python bench/simulate.py [--nodes 1000] [--jobs 100000] [--days 7] [--policies binpack,spread]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "heteroflow.settings")

from apps.scheduler.core import GpuSnap, NodeSnap, PluginSettings  # noqa: E402
from apps.scheduler.core.replay import Policy, replay, summary  # noqa: E402
from apps.scheduler.traces import Tenants, generate  # noqa: E402

TARGET_SECONDS = 120.0


def fleet(count: int) -> list[NodeSnap]:
    """`count` nodes of 8 NVIDIA cards in 4 zones of racks of 10."""
    return [
        NodeSnap(
            f"n{n:05d}",
            "online",
            True,
            zone=f"z{n % 4}",
            rack=f"z{n % 4}-r{n // 40}",
            gpus=[GpuSnap(i, "nvidia", 81920) for i in range(8)],
        )
        for n in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--policies", default="binpack,spread")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    import django

    django.setup()
    nodes = fleet(args.nodes)
    started = time.perf_counter()
    jobs = generate(args.jobs, args.days, {"nvidia": args.nodes * 8}, Tenants(), seed=args.seed)
    print(f"trace: {len(jobs)} jobs over {args.days:g} days, generated in {time.perf_counter() - started:.1f} s")
    print(f"fleet: {args.nodes} nodes × 8 cards")
    for layout in args.policies.split(","):
        policy = Policy(name=layout, settings=PluginSettings(layout=layout))
        started = time.perf_counter()
        report = replay(jobs, nodes, policy)
        elapsed = time.perf_counter() - started
        figures = summary(report)
        waits = figures["wait_seconds"]
        verdict = "meets" if elapsed <= TARGET_SECONDS else "misses"
        each = 1000 * elapsed / max(figures["cycles"], 1)
        print(
            f"{layout}: {elapsed:.1f} s for {figures['cycles']} cycles ({each:.1f} ms each), "
            f"{figures['placed']}/{figures['jobs']} placed; utilisation {100 * figures['utilisation_mean']:.1f} %; "
            f"wait p50/p90/p99 {waits['p50']}/{waits['p90']}/{waits['p99']} s; "
            f"{verdict} the {TARGET_SECONDS:.0f} s target"
        )


if __name__ == "__main__":
    main()
