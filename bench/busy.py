"""Heartbeats as a busy fleet sends them: every beat's readings differ from the last.

A steady fleet (the same readings every beat) hides the costs that only change brings:
card rows whose memory use moved (the drift judgement, the admission's measured-free
memory), power that feeds the energy accumulators, and now and then a card whose health
counters grew (the health step, its samples and cordons). The storm test, `make bench`
and `make soak` all build their beats here, so they vary alike.

`BusyFleet(prefix, nodes, gpus=8, seed=…)` gives each node's beat body for beat k:

- memory use per card: a random walk over 1–95 % of the card, with a tenth of the cards
  far above what any ledger places there (what a busy fleet's unplaced processes do);
- utilisation, temperature and power drawn fresh every beat;
- health: every node reports ECC counters; about one beat in `health_every` a card's
  corrected count grows (a changed reading, no cordon), and with `uncorrected=True` the
  same beat may grow an uncorrected count (a cordon and GPU_UNHEALTHY).

Pure: no I/O, deterministic for a seed, cheap enough for a generator sending thousands
of beats a second (one orjson dump per beat).
"""

from __future__ import annotations

import random

import orjson

from tests.nodes.payloads import heartbeat

HEALTH_FIELDS = ["ecc_corrected_volatile", "ecc_uncorrected_volatile", "ecc_corrected_aggregate"]


class BusyFleet:
    def __init__(
        self,
        prefix: str,
        nodes: int,
        *,
        gpus: int = 8,
        seed: int = 0,
        vary: bool = True,
        health_every: int = 40,
        uncorrected: bool = False,
        heartbeat_interval: int = 5,
    ):
        self.prefix, self.nodes, self.gpus, self.vary = prefix, nodes, gpus, vary
        self.health_every, self.uncorrected = health_every, uncorrected
        self.random = random.Random(seed)
        base = heartbeat(gpus=gpus)
        base.pop("live_task_ids")
        base["heartbeat_interval"] = heartbeat_interval
        self.base = base
        self.total_mb = [stat["memory_total_mb"] for stat in base["gpu_stats"]]
        # per node: each card's memory use (MB) and corrected / uncorrected ECC counts
        self.memory = [[self._start_memory(i) for i in range(gpus)] for _ in range(nodes)]
        self.corrected = [[0] * gpus for _ in range(nodes)]
        self.uncorrected_counts = [[0] * gpus for _ in range(nodes)]

    def node_id(self, n: int) -> str:
        return f"{self.prefix}-{n:05d}"

    def _start_memory(self, index: int) -> int:
        return self.random.randint(1024, int(self.total_mb[index] * 0.5))

    def body(self, n: int) -> bytes:
        """Node n's next beat (each call is the node's next beat: readings move on)."""
        payload = dict(self.base, hostname=self.node_id(n), internal_ip=f"10.{n // 65536}.{n // 256 % 256}.{n % 256}")
        if not self.vary:
            return orjson.dumps(payload)
        rnd = self.random
        stats = []
        for i, stat in enumerate(self.base["gpu_stats"]):
            total = self.total_mb[i]
            used = self.memory[n][i] + rnd.randint(-4096, 4096)
            if rnd.random() < 0.1:  # an unplaced process comes or goes
                used += rnd.choice((-1, 1)) * total // 3
            used = min(max(used, 1024), int(total * 0.95))
            self.memory[n][i] = used
            stats.append(
                dict(
                    stat,
                    memory_used_mb=used,
                    utilization=float(rnd.randint(0, 100)),
                    temperature=float(rnd.randint(35, 85)),
                    power_w=round(rnd.uniform(60.0, 700.0), 1),
                )
            )
        payload["gpu_stats"] = stats
        payload["cpu_used"] = round(rnd.uniform(1.0, 60.0), 1)
        payload["memory_used"] = round(rnd.uniform(5.0, 70.0), 1)
        payload["gpu_memory_used_mb"] = sum(self.memory[n])
        if rnd.randrange(self.health_every) == 0:
            card = rnd.randrange(self.gpus)
            self.corrected[n][card] += rnd.randint(1, 20)
            if self.uncorrected and rnd.random() < 0.05:
                self.uncorrected_counts[n][card] += 1
        payload["gpu_health"] = [
            {
                "index": i,
                "available": HEALTH_FIELDS,
                "ecc_corrected_volatile": self.corrected[n][i],
                "ecc_uncorrected_volatile": self.uncorrected_counts[n][i],
                "ecc_corrected_aggregate": self.corrected[n][i],
            }
            for i in range(self.gpus)
        ]
        return orjson.dumps(payload)
