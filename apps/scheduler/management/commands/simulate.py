"""manage.py simulate: replay work on a fleet under one policy or several, print the
figures, write report.json and the charts (docs/simulate.md)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from apps.scheduler import simulate, traces
from apps.scheduler.core.replay import DAY, replay, summary


def duration_days(text: str) -> float:
    """7d, 36h, 90m: a window of history, in days."""
    units = {"d": 1.0, "h": 1 / 24, "m": 1 / 1440}
    try:
        value = float(text[:-1]) * units[text[-1]]
    except (KeyError, ValueError, IndexError):
        raise CommandError(f"{text!r}: a duration such as 7d, 36h or 90m is expected.") from None
    if value <= 0:
        raise CommandError(f"{text!r}: a duration above zero is expected.")
    return value


class Command(BaseCommand):
    help = "Replay a trace (or this cluster's history) on a fleet under one or more policies."

    def add_arguments(self, parser):
        fleet = parser.add_argument_group("fleet (default: this cluster now, every card free)")
        fleet.add_argument("--fleet", help="a YAML fleet description")
        work = parser.add_mutually_exclusive_group(required=True)
        work.add_argument("--trace", help="a JSONL or CSV trace")
        work.add_argument("--pai", help="the Alibaba PAI GPU trace's pai_task_table.csv")
        work.add_argument("--generate", type=int, metavar="JOBS", help="a generated trace of this many jobs")
        work.add_argument("--from-history", metavar="WINDOW", help="this cluster's work submitted in the last 7d, 36h…")
        parser.add_argument("--pai-jobs", help="pai_job_table.csv, for the PAI trace's users")
        parser.add_argument("--days", type=float, default=2.0, help="a generated trace's span (days, 2)")
        parser.add_argument("--tenants", type=int, default=4, help="a generated trace's tenants (4)")
        parser.add_argument("--seed", type=int, default=1, help="a generated trace's seed (1)")
        parser.add_argument("--save-trace", help="write the trace used as JSONL here")
        parser.add_argument("--policy", action="append", default=[], help="a YAML policy (default: this cluster's)")
        parser.add_argument("--compare", action="append", default=[], help="another policy, run beside it")
        parser.add_argument("--until-days", type=float, help="stop the simulated clock after this many days")
        parser.add_argument("--out", default="simulation", help="where report.json and the charts go (simulation/)")
        parser.add_argument("--no-charts", action="store_true", help="only report.json")

    def handle(self, *args, **options):
        tenants = traces.Tenants()
        try:
            fleet = simulate.fleet_from_yaml(options["fleet"]) if options["fleet"] else simulate.fleet_of_cluster()
            if not fleet:
                raise CommandError("The fleet has no schedulable node: describe one with --fleet.")
            jobs = self.work(options, fleet, tenants)
            policies = [simulate.policy_from_yaml(path, tenants) for path in options["policy"] + options["compare"]]
        except (simulate.SimulationInputError, traces.TraceError) as exc:
            raise CommandError(str(exc)) from None
        if not policies:
            policies = [simulate.policy_of_cluster()]
        if options["save_trace"]:
            traces.write_trace(jobs, options["save_trace"], tenants)
        cards = sum(len(node.gpus) for node in fleet)
        self.stdout.write(f"fleet: {len(fleet)} nodes, {cards} cards; work: {len(jobs)} jobs")
        comparison = simulate.Comparison(tenants=tenants)
        until = options["until_days"] * DAY if options["until_days"] else None
        for policy in policies:
            started = time.perf_counter()
            report = replay(jobs, fleet, policy, until=until, progress=self.progress(policy.name))
            elapsed = time.perf_counter() - started
            comparison.runs.append(report)
            figures = summary(report)
            if sys.stderr.isatty():
                sys.stderr.write("\n")
            waits = figures["wait_seconds"]
            self.stdout.write(
                f"{policy.name}: {figures['placed']}/{figures['jobs']} placed in {figures['cycles']} cycles, "
                f"{elapsed:.1f} s; utilisation {100 * figures['utilisation_mean']:.1f} %; "
                f"wait p50 {_minutes(waits['p50'])}, p90 {_minutes(waits['p90'])}, p99 {_minutes(waits['p99'])}; "
                f"idle cards on partly used nodes {figures['fragmentation']['idle_cards_on_partly_used_nodes_mean']}"
            )
        out = Path(options["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(comparison.as_json(), indent=2))
        written = [] if options["no_charts"] else simulate.draw_charts(comparison, out)
        self.stdout.write(f"wrote {out / 'report.json'}" + "".join(f", {path}" for path in written))

    def work(self, options, fleet, tenants):
        if options["trace"]:
            return traces.read_trace(options["trace"], tenants)
        if options["pai"]:
            imported = traces.read_pai(options["pai"], tenants, options["pai_jobs"])
            if imported.skipped:
                skipped = ", ".join(f"{count} {why}" for why, count in sorted(imported.skipped.items()))
                self.stdout.write(f"PAI trace: {len(imported.jobs)} jobs; rows skipped: {skipped}")
            if not imported.jobs:
                raise CommandError(f"{options['pai']}: no task that used GPUs and ran.")
            return imported.jobs
        if options["generate"] is not None:
            if options["generate"] < 1 or options["days"] <= 0 or options["tenants"] < 1:
                raise CommandError("--generate, --days and --tenants are above zero.")
            return traces.generate(
                options["generate"],
                options["days"],
                simulate.gpu_types(fleet),
                tenants,
                tenant_count=options["tenants"],
                seed=options["seed"],
            )
        jobs = simulate.jobs_from_history(duration_days(options["from_history"]), tenants)
        if not jobs:
            raise CommandError(f"No work that ran was submitted in the last {options['from_history']}.")
        return jobs

    def progress(self, name: str):
        """The share of the trace's arrivals simulated: redrawn in place on a terminal,
        a line every 10 % otherwise."""
        step = 1 if sys.stderr.isatty() else 10
        last = [-1]

        def show(done: float) -> None:
            percent = int(done * 100) // step * step
            if percent != last[0]:
                last[0] = percent
                sys.stderr.write(f"\r{name}: {percent} %" if step == 1 else f"{name}: {percent} %\n")
                sys.stderr.flush()

        return show


def _minutes(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds / 60:.1f} min"
