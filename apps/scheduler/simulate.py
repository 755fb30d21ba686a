"""The simulator's shell (docs/simulate.md): a fleet (a YAML description, or this cluster
now), work (a trace file, the PAI trace, a generated trace, or this cluster's history) and
policies (YAML, or this cluster's settings and queues) turned into the pure replay's
inputs (apps.scheduler.core.replay); its reports summed up as JSON and drawn as PNG
charts. `manage.py simulate` and `make bench-simulate` run it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import yaml
from django.db import connection

from apps.core.clock import utcnow
from apps.nodes.choices import GpuVendor
from apps.scheduler import quotas
from apps.scheduler.core import GpuSnap, NodeSnap, PluginSettings
from apps.scheduler.core.forecast import idle_fleet
from apps.scheduler.core.queues import QueueSpec, Quota
from apps.scheduler.core.replay import DAY, Job, Policy, Report, summary
from apps.scheduler.plugins import plugin_settings
from apps.scheduler.snapshot import load_nodes
from apps.scheduler.traces import Tenants

SCORES = ("topology", "rdma", "nvlink", "replica-spread", "model-cache")
FLEET_KEYS = {"name", "count", "gpus", "vendor", "memory_mb", "zones", "racks_per_zone", "labels"}
POLICY_KEYS = {
    "timeout_seconds",
    "name",
    "layout",
    "plugins",
    "weights",
    "reserve_after_seconds",
    "backfill",
    "cycle_seconds",
    "fair_share",
}


class SimulationInputError(ValueError):
    """A fleet or policy description that cannot be used, saying what is wrong."""


# --- the fleet ---------------------------------------------------------------------------------------


def fleet_from_yaml(path: str | Path) -> list[NodeSnap]:
    """A fleet description's file (fleet_from_document)."""
    return fleet_from_document(_yaml(path), str(path))


MAX_NODES = 20_000


def fleet_from_document(document, path: str = "fleet") -> list[NodeSnap]:
    """`nodes:` a list of node types, each {name, count, gpus, vendor (nvidia), memory_mb
    (81920), zones ([""]), racks_per_zone (1), labels ({})}: `count` nodes named
    name-1…, spread over the zones and their racks in turn (at most MAX_NODES in all)."""
    types = document.get("nodes") if isinstance(document, dict) else None
    if not isinstance(types, list) or not types:
        raise SimulationInputError(f"{path}: a list `nodes:` of node types is expected.")
    counts = [spec.get("count") for spec in types if isinstance(spec, dict)]
    if sum(count for count in counts if isinstance(count, int)) > MAX_NODES:
        raise SimulationInputError(f"{path}: at most {MAX_NODES} nodes.")
    fleet = []
    for position, spec in enumerate(types, start=1):
        where = f"{path}: node type {position}"
        if not isinstance(spec, dict):
            raise SimulationInputError(f"{where}: a mapping is expected.")
        unknown = sorted(set(spec) - FLEET_KEYS)
        if unknown:
            raise SimulationInputError(f"{where}: unknown {', '.join(unknown)}.")
        try:
            name, count, cards = str(spec["name"]), int(spec["count"]), int(spec["gpus"])
            memory = int(spec.get("memory_mb", 81920))
        except (KeyError, TypeError, ValueError) as exc:
            raise SimulationInputError(f"{where}: name, count and gpus are required ({exc}).") from None
        vendor = str(spec.get("vendor", "nvidia")).lower()
        if vendor not in GpuVendor.values:
            raise SimulationInputError(f"{where}: vendor {vendor!r} is not one of {', '.join(GpuVendor.values)}.")
        if count < 1 or cards < 1:
            raise SimulationInputError(f"{where}: count and gpus are at least 1.")
        zones = [str(zone) for zone in spec.get("zones") or [""]]
        racks = max(1, int(spec.get("racks_per_zone", 1)))
        for number in range(1, count + 1):
            zone = zones[(number - 1) % len(zones)]
            rack = f"{zone or name}-r{(number - 1) // len(zones) % racks + 1}"
            fleet.append(
                NodeSnap(
                    id=f"{name}-{number}",
                    status="online",
                    executable=True,
                    labels=dict(spec.get("labels") or {}),
                    zone=zone,
                    rack=rack,
                    gpus=[GpuSnap(index=i, vendor=vendor, memory_total_mb=memory) for i in range(cards)],
                )
            )
    return fleet


def fleet_of_cluster() -> list[NodeSnap]:
    """This cluster's schedulable nodes now, every card free."""
    return idle_fleet(load_nodes())


def gpu_types(fleet: Sequence[NodeSnap]) -> dict[str, int]:
    """Cards per type: what a generated trace asks for, in proportion."""
    counts: dict[str, int] = {}
    for node in fleet:
        for gpu in node.gpus:
            counts[gpu.vendor.lower()] = counts.get(gpu.vendor.lower(), 0) + 1
    return counts


# --- policies ----------------------------------------------------------------------------------------


def policy_from_yaml(path: str | Path, tenants: Tenants) -> Policy:
    """A policy's file (policy_from_document), named after the file unless it says."""
    document = _yaml(path)
    if isinstance(document, dict):
        document.setdefault("name", Path(path).stem)
    return policy_from_document(document, tenants, str(path))


def policy_from_document(document, tenants: Tenants, path: str = "policy") -> Policy:
    """{name, layout (spread | binpack), plugins (the scores enabled), weights,
    reserve_after_seconds (null: gangs never reserve), backfill, cycle_seconds, fair_share:
    {half_life_days, queues: {tenant: {weight, cohort, nominal: {type: n},
    borrowing_limit: {type: n}, lending_limit: {type: n}}}}}; anything left out is the
    default PluginSettings' and Policy's."""
    if not isinstance(document, dict):
        raise SimulationInputError(f"{path}: a mapping is expected.")
    unknown = sorted(set(document) - POLICY_KEYS)
    if unknown:
        raise SimulationInputError(f"{path}: unknown {', '.join(unknown)}.")
    defaults = PluginSettings()
    layout = document.get("layout", defaults.layout)
    if layout not in ("spread", "binpack"):
        raise SimulationInputError(f"{path}: layout is spread or binpack, not {layout!r}.")
    plugins = document.get("plugins")
    if plugins is not None and not set(plugins) <= set(SCORES):
        raise SimulationInputError(f"{path}: plugins are of {', '.join(SCORES)}.")
    try:
        weights = dict(defaults.weights) | {str(k): float(v) for k, v in (document.get("weights") or {}).items()}
        cycle = float(document.get("cycle_seconds", 30))
    except (AttributeError, TypeError, ValueError):
        raise SimulationInputError(f"{path}: weights are numbers by plugin, cycle_seconds a number.") from None
    if not 1 <= cycle <= 3600:
        raise SimulationInputError(f"{path}: cycle_seconds is 1–3600.")
    settings = PluginSettings(
        layout=layout, weights=weights, enabled=frozenset(plugins) if plugins is not None else defaults.enabled
    )
    fair = document.get("fair_share") or {}
    specs = []
    for tenant, spec in (fair.get("queues") or {}).items():
        spec = spec or {}
        limits = {key: spec.get(key) or {} for key in ("nominal", "borrowing_limit", "lending_limit")}
        types = set().union(*limits.values())
        specs.append(
            QueueSpec(
                tenant_id=tenants.id(str(tenant)),
                name=str(tenant),
                cohort=spec.get("cohort"),
                weight=float(spec.get("weight", 1.0)),
                quotas={
                    str(gpu_type): Quota(
                        float(limits["nominal"].get(gpu_type, 0)),
                        limits["borrowing_limit"].get(gpu_type),
                        limits["lending_limit"].get(gpu_type),
                    )
                    for gpu_type in types
                },
            )
        )
    reserve = document.get("reserve_after_seconds", 300.0)
    try:
        timeout = float(document.get("timeout_seconds", 3 * DAY))
    except (TypeError, ValueError):
        raise SimulationInputError(f"{path}: timeout_seconds is a number.") from None
    return Policy(
        name=str(document.get("name") or "policy"),
        settings=settings,
        specs=tuple(specs),
        half_life_seconds=float(fair.get("half_life_days", 7)) * DAY,
        reserve_after_seconds=None if reserve is None else float(reserve),
        backfill=bool(document.get("backfill", True)),
        cycle_seconds=cycle,
        timeout_seconds=timeout,
    )


def policy_of_cluster() -> Policy:
    """This cluster's placement settings and tenants' queues."""
    from django.conf import settings as django_settings

    book = quotas.queue_book(utcnow())
    return Policy(
        name="this cluster",
        settings=plugin_settings(),
        specs=tuple(book.specs.values()),
        half_life_seconds=quotas.half_life_seconds(),
        reserve_after_seconds=django_settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS,
    )


# --- this cluster's history --------------------------------------------------------------------------

# The single tasks and gangs submitted in the window that ran, with their run time: a gang
# once (its first member's start to its last member's end; still running: until now).
HISTORY_SQL = """
    SELECT t.id, t.created_at, t.tenant_id, t.gpu_required, t.gpu_type, t.priority, 1,
           coalesce(t.finished_at, %(now)s) - t.started_at, t.max_duration_seconds
    FROM tasks t
    WHERE t.group_id IS NULL AND t.started_at IS NOT NULL AND t.created_at >= %(since)s AND t.gpu_required > 0
    UNION ALL
    SELECT -g.id, g.created_at, g.tenant_id, g.gpus_per_worker, g.gpu_type, g.priority, g.world_size,
           coalesce(max(t.finished_at), %(now)s) - min(t.started_at), max(t.max_duration_seconds)
    FROM task_groups g JOIN tasks t ON t.group_id = g.id
    WHERE g.placement = 'gang' AND g.created_at >= %(since)s
    GROUP BY g.id HAVING bool_and(t.started_at IS NOT NULL)
    ORDER BY 2
"""


def jobs_from_history(days: float, tenants: Tenants) -> list[Job]:
    """The work this cluster ran that was submitted in the last `days`: when, how many
    cards of which type, how long it ran (tenants named by their slug)."""
    now = utcnow()
    since = now - timedelta(days=days)
    with connection.cursor() as cursor:
        cursor.execute("SELECT id, slug FROM tenants")
        slugs = dict(cursor.fetchall())
        cursor.execute(HISTORY_SQL, {"now": now, "since": since})
        rows = cursor.fetchall()
    jobs = []
    for number, (_, created, tenant_id, gpus, gpu_type, priority, workers, ran, declared) in enumerate(rows, start=1):
        duration = ran.total_seconds() if ran is not None else 0.0
        if duration <= 0:
            continue
        jobs.append(
            Job(
                id=number,
                submit=(created - since).total_seconds(),
                tenant_id=tenants.id(slugs.get(tenant_id, str(tenant_id))),
                gpus=gpus,
                duration=duration,
                gpu_type=(gpu_type or "nvidia").lower(),
                priority=priority,
                workers=workers,
                declared=float(declared) if declared else None,
            )
        )
    return jobs


# --- the report --------------------------------------------------------------------------------------


@dataclass
class Comparison:
    """Runs of the same work and fleet under several policies."""

    runs: list[Report] = field(default_factory=list)
    tenants: Tenants = field(default_factory=Tenants)

    def as_json(self) -> dict:
        documents = []
        for report in self.runs:
            document = summary(report)
            document["wait_seconds_by_tenant"] = {
                self.tenants.name(int(tenant)): figures
                for tenant, figures in document["wait_seconds_by_tenant"].items()
            }
            document["utilisation"] = [[round(at), round(used, 4)] for at, used, _, _ in report.samples]
            document["idle_cards_on_partly_used_nodes"] = [[round(at), idle] for at, _, idle, _ in report.samples]
            documents.append(document)
        return {"runs": documents}


def draw_charts(comparison: Comparison, out: Path) -> list[Path]:
    """utilisation.png, waits.png and fragmentation.png in `out`: a line (or a bar
    group) per policy. The Agg backend: no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(figure, name: str) -> None:
        path = out / name
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        pyplot.close(figure)
        written.append(path)

    figure, axes = pyplot.subplots(figsize=(9, 3.5))
    for report in comparison.runs:
        axes.plot([s[0] / 3600 for s in report.samples], [100 * s[1] for s in report.samples], label=report.policy)
    axes.set(xlabel="hours", ylabel="cards in use (%)", title="Utilisation", ylim=(0, 100))
    axes.legend()
    save(figure, "utilisation.png")

    figure, axes = pyplot.subplots(figsize=(9, 3.5))
    tenant_names = sorted({tenant for report in comparison.runs for tenant in _waits_by_tenant(report)})
    width = 0.8 / max(len(comparison.runs), 1)
    for offset, report in enumerate(comparison.runs):
        waits = _waits_by_tenant(report)
        axes.bar(
            [i + offset * width for i in range(len(tenant_names))],
            [waits.get(name, 0) / 60 for name in tenant_names],
            width=width,
            label=report.policy,
        )
    axes.set_xticks([i + width * (len(comparison.runs) - 1) / 2 for i in range(len(tenant_names))])
    axes.set_xticklabels([comparison.tenants.name(name) for name in tenant_names])
    axes.set(ylabel="p90 wait (minutes)", title="Waits by tenant (p90)")
    axes.legend()
    save(figure, "waits.png")

    figure, axes = pyplot.subplots(figsize=(9, 3.5))
    for report in comparison.runs:
        axes.plot([s[0] / 3600 for s in report.samples], [s[2] for s in report.samples], label=report.policy)
    axes.set(xlabel="hours", ylabel="idle cards on partly used nodes", title="Fragmentation")
    axes.legend()
    save(figure, "fragmentation.png")
    return written


def _waits_by_tenant(report: Report) -> dict[int, float]:
    """Per tenant, the p90 wait (seconds)."""
    waits: dict[int, list[float]] = {}
    for outcome in report.outcomes.values():
        if outcome.start is not None:
            waits.setdefault(outcome.job.tenant_id, []).append(outcome.start - outcome.job.submit)
    return {
        tenant: sorted(values)[min(len(values) - 1, math.ceil(0.9 * len(values)) - 1)]
        for tenant, values in waits.items()
    }


def _yaml(path: str | Path):
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise SimulationInputError(f"{path}: {exc.strerror}.") from None
    except yaml.YAMLError as exc:
        raise SimulationInputError(f"{path}: not YAML ({exc}).") from None
