"""The scheduler's configuration: its plugins (PLUGINS), the effective table of them that
the API shows and the cycle reads (plugin_table, plugin_settings), their options, and
the tenants' sharing rule for a cycle."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations

from django.conf import settings as django_settings
from django.db import transaction
from rest_framework.exceptions import ValidationError

from apps.core.errors import Conflict
from apps.scheduler.core import (
    PREEMPT_STAGES,
    PluginSettings,
)
from apps.scheduler.error_codes import SchedulerErrorCode
from apps.scheduler.load import THRESHOLD_FIELDS
from apps.scheduler.models import PluginConfig
from apps.tenants.models import TenantGroup


@dataclass(frozen=True)
class PluginSpec:
    name: str
    kind: str  # "filter", "score" or "postfilter" (after a failed placement)
    default_enabled: bool
    locked: bool = False  # correctness plugins: always on
    exclusive_with: str = ""
    default_weight: float = 1.0
    default_extra: dict = field(default_factory=dict)


# The plugins the scheduler runs, in pipeline order.
PLUGINS: dict[str, PluginSpec] = {
    spec.name: spec
    for spec in (
        PluginSpec("gpu-filter", "filter", True, locked=True),
        PluginSpec("resource-filter", "filter", True, locked=True),
        PluginSpec("spread", "score", True, exclusive_with="binpack"),
        PluginSpec("binpack", "score", False, exclusive_with="spread"),
        PluginSpec("topology", "score", True),
        PluginSpec("rdma", "score", True),
        PluginSpec("nvlink", "score", True),
        # an inference service's replicas prefer nodes without another replica of it
        PluginSpec("replica-spread", "score", True),
        # a replica prefers the nodes that already hold its model (no fetch before it starts)
        PluginSpec("model-cache", "score", True),
        PluginSpec("preempt", "postfilter", True, default_weight=0.0, default_extra={"preempt_stage": "running"}),
    )
}


def plugin_table() -> list[dict]:
    """The effective configuration: stored rows over defaults. The scheduler reads this
    very function every cycle, so the API can never show a set it does not use."""
    stored = {config.name: config for config in PluginConfig.objects.filter(name__in=PLUGINS)}
    table = []
    for name, spec in PLUGINS.items():
        config = stored.get(name)
        enabled = True if spec.locked else (config.enabled if config else spec.default_enabled)
        table.append(
            {
                "name": name,
                "kind": spec.kind,
                "enabled": enabled,
                "locked": spec.locked,
                "weight": config.weight if config else spec.default_weight,
                "extra": spec.default_extra | (config.extra if config else {}),
            }
        )
    return table


def plugin_settings() -> PluginSettings:
    table = {row["name"]: row for row in plugin_table()}
    layout = "binpack" if table["binpack"]["enabled"] else "spread"
    scores = ("topology", "rdma", "nvlink", "replica-spread", "model-cache")
    enabled = frozenset(name for name in scores if table[name]["enabled"])
    weights = {name: table[name]["weight"] for name in ("spread", "binpack", *scores)}
    thresholds = {
        option: float(value)
        for option, value in table["resource-filter"]["extra"].items()
        if option in THRESHOLD_FIELDS and isinstance(value, (int, float))
    }
    preempt = table["preempt"]
    stage = preempt["extra"].get("preempt_stage", "running") if preempt["enabled"] else "disabled"
    return PluginSettings(
        layout=layout,
        weights=weights,
        enabled=enabled,
        preempt_stage=stage,
        inference_cap=django_settings.HETEROFLOW_INFERENCE_CONTAINERS_PER_NODE,
        **thresholds,
    )


def set_plugin_enabled(name: str, enabled: bool) -> None:
    """Enable or disable a plugin. The layout plugins are exclusive: enabling one
    disables the other, and disabling one enables the other (there is always a layout)."""
    spec = PLUGINS[name]
    if spec.locked:
        raise Conflict(
            f"'{name}' keeps the scheduler correct and cannot be disabled or enabled.", SchedulerErrorCode.PLUGIN_LOCKED
        )
    with transaction.atomic():
        PluginConfig.objects.update_or_create(name=name, defaults={"enabled": enabled})
        if spec.exclusive_with:
            PluginConfig.objects.update_or_create(name=spec.exclusive_with, defaults={"enabled": not enabled})


# What each plugin's `extra` may hold: name -> check of the value (an error message or "")
def _percent(value) -> str:
    return (
        ""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 100
        else "a number from 0 to 100"
    )


def _temperature(value) -> str:
    return (
        ""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 150
        else "degrees Celsius, 0 to 150"
    )


EXTRA_OPTIONS: dict[str, dict] = {
    "resource-filter": {
        "cpu_percent_max": _percent,
        "memory_percent_max": _percent,
        "gpu_memory_percent_max": _percent,
        "gpu_utilization_max": _percent,
        "gpu_temperature_max": _temperature,
    },
    "preempt": {
        "preempt_stage": lambda value: "" if value in PREEMPT_STAGES else f"one of {', '.join(PREEMPT_STAGES)}"
    },
}


def checked_extra(name: str, extra: dict) -> dict:
    """`extra` checked against what the plugin reads; a key set to null goes back to
    its default. Anything unknown or out of range is refused with nothing written."""
    options = EXTRA_OPTIONS.get(name, {})
    problems = {}
    for key, value in extra.items():
        if key not in options:
            problems[key] = [
                f"'{name}' has no option '{key}'" + (f"; it has {', '.join(options)}." if options else ".")
            ]
        elif value is not None and (problem := options[key](value)):
            problems[key] = [f"Must be {problem}."]
    if problems:
        raise ValidationError({"extra": problems})
    return extra


def set_plugin_options(name: str, *, weight: float | None = None, extra: dict | None = None) -> None:
    """Change a plugin's weight and `extra` (merged over what is stored)."""
    defaults = {}
    if weight is not None:
        defaults["weight"] = weight
    if extra is not None:
        checked_extra(name, extra)
        stored = PluginConfig.objects.filter(name=name).values_list("extra", flat=True).first() or {}
        defaults["extra"] = {key: value for key, value in (stored | extra).items() if value is not None}
    if defaults:
        row, created = PluginConfig.objects.get_or_create(
            name=name, defaults={"enabled": PLUGINS[name].default_enabled, **defaults}
        )
        if not created:
            for option, value in defaults.items():
                setattr(row, option, value)
            row.save()


def sharing_rule():
    """tenants_may_share for a whole cycle, from one query (fail-closed: a tenant in no
    group shares with nobody but itself)."""
    pairs = set()
    for group in TenantGroup.objects.prefetch_related("tenants"):
        members = sorted(tenant.pk for tenant in group.tenants.all())
        pairs.update(combinations(members, 2))

    def may_share(a: int, b: int) -> bool:
        return a == b or (min(a, b), max(a, b)) in pairs

    return may_share
