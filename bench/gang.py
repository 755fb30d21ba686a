"""Group placement's decision time in the pure core (no database): 1,000 nodes × 8 GPUs
in racks of 20 and zones of 5 racks, a quarter of the cards already held, then groups of
4 to 32 workers placed one by one on fresh snapshots; prints p50/p99/max per group size.
The target is a 32-worker group in at most 50 ms. Asserts nothing.

    .venv/bin/python bench/gang.py [--nodes 1000] [--runs 20]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "heteroflow.settings")

from apps.scheduler.core import FleetView, GpuSnap, GroupReq, NodeSnap, PluginSettings, place_group  # noqa: E402


def fleet(count: int, seed: int) -> list[NodeSnap]:
    rng = random.Random(seed)
    nodes = []
    for n in range(count):
        cards = [GpuSnap(i, "nvidia", 81920) for i in range(8)]
        for card in rng.sample(cards, rng.choice((0, 0, 2, 4))):
            card.holders.append((10**6 + n, 1, None))
        nodes.append(
            NodeSnap(
                f"n{n:05d}",
                "online",
                True,
                None,
                {},
                "r1",
                f"z{n // 100}",
                f"k{n // 20}",
                rng.uniform(5, 60),
                rng.uniform(5, 60),
                cards,
            )
        )
    return nodes


SHAPES = ((4, 8), (8, 4), (16, 8), (32, 8), (32, 2))  # (workers, cards per worker)
TARGET_MS = 50.0  # a 32-worker group's decision time


def time_group(views, workers: int, per_worker: int, strategy: str, gpu_type: str = "nvidia") -> list[float]:
    """Milliseconds to place one group of this shape on each fleet view of `views` (a
    fresh view each: the decision is timed on the fleet as a cycle would find it)."""
    times = []
    for run, view in enumerate(views):
        group = GroupReq(run, 1, tuple(range(10**7, 10**7 + workers)), per_worker, gpu_type, strategy)
        gc.disable()  # as the scheduler's cycle runs (run_cycle): no collector pauses in the decision
        start = time.perf_counter()
        outcome = place_group(group, view)
        times.append((time.perf_counter() - start) * 1000)
        gc.enable()
        assert not hasattr(outcome, "message"), outcome
    return sorted(times)


def summary(times: list[float]) -> str:
    return (
        f"p50 {times[len(times) // 2]:6.2f} ms  p99 {times[min(len(times) - 1, int(len(times) * 0.99))]:6.2f} ms  "
        f"max {times[-1]:6.2f} ms"
    )


def verdict(times: list[float]) -> str:
    """The target line's verdict on a 32-worker group's p99."""
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
    return f"target <= {TARGET_MS:.0f} ms: {'PASS' if p99 <= TARGET_MS else 'FAIL'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    settings = PluginSettings()
    for workers, per_worker in SHAPES:
        for strategy in ("ddp", "pp"):
            views = (FleetView(fleet(args.nodes, run), settings, lambda a, b: a == b) for run in range(args.runs))
            times = time_group(views, workers, per_worker, strategy)
            target = f"  ({verdict(times)})" if workers == 32 else ""
            print(f"{workers:>3} workers × {per_worker} cards, {strategy:>4}: {summary(times)}{target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
