"""The GPU health reads the API and the health page share (docs/gpu-health.md): the cards
by risk with their evidence, one card's history, the capability matrix (what each
vendor's agents declared they can read). Scoped like the node list: operators see every
card, a tenant the cards of the nodes visible to it."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.db.models import (
    BigIntegerField,
    BooleanField,
    Case,
    Count,
    F,
    IntegerField,
    OuterRef,
    Q,
    Subquery,
    Value,
    When,
)
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Greatest
from rest_framework.exceptions import NotFound

from apps.core.clock import utcnow
from apps.nodes.choices import GpuVendor
from apps.nodes.health import COUNTERS, FLAGS
from apps.nodes.models import Gpu, GpuHealthSample, Node
from apps.nodes.prediction import model_statistics

RISK_CORDONED, RISK_EVIDENCE, RISK_NONE = 0, 1, 2
RISK_NAMES = {RISK_CORDONED: "cordoned", RISK_EVIDENCE: "evidence", RISK_NONE: "none"}
RISING_DAYS = 7  # a rise of the corrected counts at the card's latest change, if that was this recent

# What an agent may declare in a reading's `available` (the capability matrix's columns).
CAPABILITY_FIELDS = ("ecc_mode", *COUNTERS, *FLAGS, "xid_events", "throttle_reasons")


def _counter(name: str, gpu: str = "gpus") -> str:
    """A counter of the card's latest reading (gpus.health), NULL when not read."""
    return f"(CASE WHEN jsonb_typeof({gpu}.health -> '{name}') = 'number' THEN ({gpu}.health ->> '{name}')::bigint END)"


def _flag(name: str, gpu: str = "gpus") -> str:
    return f"COALESCE({gpu}.health -> '{name}' = 'true'::jsonb, false)"


def uncorrected_sql(gpu: str = "gpus") -> str:
    return f"GREATEST({_counter('ecc_uncorrected_volatile', gpu)}, {_counter('ecc_uncorrected_aggregate', gpu)})"


def corrected_sql(gpu: str = "gpus") -> str:
    return f"GREATEST({_counter('ecc_corrected_volatile', gpu)}, {_counter('ecc_corrected_aggregate', gpu)})"


def health_summary_sql(gpu: str, timestamp) -> str:
    """The card's health in a node answer (apps.nodes.presenters), as a JSON expression:
    null when the card never reported health; counts null when not read. `timestamp`
    formats a timestamp expression the presenter's way."""
    pending = " OR ".join(_flag(name, gpu) for name in ("retired_pages_pending", "remapped_rows_pending"))
    return (
        f"CASE WHEN {gpu}.health_at IS NULL THEN NULL ELSE json_build_object("
        f"'at', {timestamp(f'{gpu}.health_at')}, 'last_bad_at', {timestamp(f'{gpu}.last_bad_at')}, "
        f"'ecc_corrected', {corrected_sql(gpu)}, 'ecc_uncorrected', {uncorrected_sql(gpu)}, "
        f"'pending', {pending}, 'remapped_rows_failure', {_flag('remapped_rows_failure', gpu)}) END"
    )


def _reading(name: str):
    """A counter of the card's latest reading (gpus.health) as a number, NULL when not
    read (the schema admits only whole numbers there)."""
    return Cast(KeyTextTransform(name, "health"), BigIntegerField())


def _greatest(*names: str):
    """PostgreSQL's GREATEST skips NULLs: the larger of the counts read, NULL if none is."""
    return Greatest(*(_reading(name) for name in names))


def _previous(column: str):
    """The column of the card's sample before its latest change."""
    return Subquery(
        GpuHealthSample.objects.filter(
            node_id=OuterRef("node_id"), gpu_index=OuterRef("index"), at__lt=OuterRef("health_at")
        )
        .order_by("-at", "-id")
        .values(column)[:1]
    )


def scoped_cards(principal):
    """The cards of the nodes the principal may see (the nodes' own scoping)."""
    return Gpu.objects.filter(node__in=Node.objects.visible_to(principal))


def with_risk(cards, now=None):
    """Each card with its risk tier, its larger uncorrected and corrected counts (NULL: not
    read) and whether the corrected counts rose at its latest change (compared with the
    sample before it), if that change is within RISING_DAYS."""
    now = now or utcnow()
    cards = cards.annotate(
        uncorrected=_greatest("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate"),
        corrected=_greatest("ecc_corrected_volatile", "ecc_corrected_aggregate"),
        aggregate_now=_reading("ecc_corrected_aggregate"),
        volatile_now=_reading("ecc_corrected_volatile"),
        aggregate_before=_previous("ecc_corrected_aggregate"),
        volatile_before=_previous("ecc_corrected_volatile"),
    )
    rising = Q(health_at__gte=now - timedelta(days=RISING_DAYS)) & (
        Q(aggregate_now__gt=F("aggregate_before")) | Q(volatile_now__gt=F("volatile_before"))
    )
    evidence = (
        Q(uncorrected__gt=0)
        | Q(health__retired_pages_pending=True)
        | Q(health__remapped_rows_pending=True)
        | Q(health__remapped_rows_failure=True)
        | rising
    )
    return cards.annotate(
        rising=Case(When(rising, then=Value(True)), default=Value(False), output_field=BooleanField()),
        risk=Case(
            When(cordoned_at__isnull=False, then=Value(RISK_CORDONED)),
            When(evidence, then=Value(RISK_EVIDENCE)),
            default=Value(RISK_NONE),
            output_field=IntegerField(),
        ),
    )


def cards_by_risk(principal, *, risk: str = "", model: str = ""):
    """The visible cards, riskiest first: cordoned (or unhealthy), then those with evidence
    (uncorrected errors, pending retirements or remaps, a remapping failure, corrected
    errors rising), then the rest; within each the most uncorrected, then corrected,
    errors first. A queryset: paginate before evaluating."""
    cards = with_risk(scoped_cards(principal).with_state().select_related("node"))
    if risk:
        cards = cards.filter(risk={name: value for value, name in RISK_NAMES.items()}[risk])
    if model:
        cards = cards.filter(model=model)
    return cards.order_by(
        "risk",
        F("uncorrected").desc(nulls_last=True),
        F("corrected").desc(nulls_last=True),
        "node_id",
        "index",
    )


def card_or_404(node: Node, index: int) -> Gpu:
    """One card of a node the caller may see (look the node up scoped), with its risk."""
    gpu = with_risk(Gpu.objects.with_state().select_related("node").filter(node=node, index=index)).first()
    if gpu is None:
        raise NotFound(f"Node '{node.pk}' has no GPU {index}.")
    return gpu


PREDICTION_CAVEAT = (
    "Not validated: the prediction has not been checked against real failure data. It is the fraction, so far, "
    "of a model's cards seen with corrected ECC errors that later became unhealthy; cards seen recently have had "
    "little time to fail. Shown only with enough cards; otherwise: not enough data."
)


def prediction_min_cards() -> int:
    return settings.HETEROFLOW_GPU_HEALTH_PREDICTION_MIN_CARDS


def statistics_by_model(principal) -> dict:
    """model → prediction.ModelStatistics, over the history of the nodes visible to the
    principal (all of it for operators)."""
    scope = None if principal.is_operator else Node.objects.visible_to(principal).values("id")
    return {stats.model: stats for stats in model_statistics(scope)}


def evidence(gpu: Gpu) -> list[dict]:
    """What the card's latest reading shows that puts it at risk, in words."""
    health = gpu.health or {}
    shown: list[dict] = []
    uncorrected = {name: health.get(name) for name in ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate")}
    if any(isinstance(value, int) and value > 0 for value in uncorrected.values()):
        parts = [f"{name.rsplit('_', 1)[1]} {value}" for name, value in uncorrected.items() if value is not None]
        shown.append({"code": "uncorrected_ecc", "message": "uncorrected ECC errors: " + ", ".join(parts)})
    if health.get("retired_pages_pending") is True:
        shown.append({"code": "retirement_pending", "message": "page retirement pending (a reset applies it)"})
    if health.get("remapped_rows_pending") is True:
        shown.append({"code": "remap_pending", "message": "row remapping pending (a reset applies it)"})
    if health.get("remapped_rows_failure") is True:
        shown.append({"code": "remap_failure", "message": "row remapping failed"})
    if getattr(gpu, "rising", False):
        shown.append({"code": "corrected_rising", "message": "corrected ECC errors rising"})
    elif isinstance(getattr(gpu, "corrected", None), int) and gpu.corrected > 0:
        shown.append({"code": "corrected_ecc", "message": f"corrected ECC errors: {gpu.corrected}"})
    throttling = health.get("throttle_reasons") or []
    if throttling:
        shown.append({"code": "throttling", "message": "hardware throttling: " + ", ".join(throttling)})
    return shown


def prediction_for(gpu: Gpu, stats: dict) -> dict:
    """The card's failure prediction: the model's empirical fraction for a card with
    corrected errors, when the model has enough such cards; else why there is none."""
    model_stats = stats.get(gpu.model)
    base = {
        "status": "no_data",
        "failure_fraction": None,
        "interval": None,
        "cards_with_corrected": model_stats.cards_with_corrected if model_stats else 0,
        "became_unhealthy": model_stats.became_unhealthy if model_stats else 0,
    }
    if not gpu.health:
        return base
    corrected = getattr(gpu, "corrected", None)
    if not isinstance(corrected, int) or corrected <= 0:
        return base | {"status": "not_applicable"}  # the prediction is about cards with corrected errors
    if model_stats is None or model_stats.status != "estimate":
        return base | {"status": "not_enough_data"}
    return base | {
        "status": "estimate",
        "failure_fraction": model_stats.failure_fraction,
        "interval": [model_stats.interval_low, model_stats.interval_high],
    }


def _iso(value):
    return value.isoformat().replace("+00:00", "Z") if value else None


def present_card(gpu: Gpu, stats: dict) -> dict:
    return {
        "node_id": gpu.node_id,
        "node_name": gpu.node.name,
        "index": gpu.index,
        "uuid": gpu.uuid,
        "vendor": gpu.vendor,
        "model": gpu.model,
        "state": gpu.state,
        "risk": RISK_NAMES[gpu.risk],
        "cordoned": gpu.cordoned_at is not None,
        "cordon_source": gpu.cordon_source or None,
        "cordon_reason": gpu.cordon_reason or None,
        "cordoned_at": _iso(gpu.cordoned_at),
        "cordon_evidence": gpu.cordon_evidence or None,
        "last_bad_at": _iso(gpu.last_bad_at),
        "health_at": _iso(gpu.health_at),
        "health": gpu.health or None,
        "evidence": evidence(gpu),
        "prediction": prediction_for(gpu, stats),
    }


def card_samples(node: Node, index: int):
    """The card's history, newest first (paginate before evaluating)."""
    return GpuHealthSample.objects.filter(node_id=node.pk, gpu_index=index).order_by("-at", "-id")


SAMPLE_FIELDS = (
    "at",
    *COUNTERS,
    *FLAGS,
    "xid_events",
    "throttle_reasons",
    "available",
    "unhealthy",
    "reasons",
)


def present_sample(sample: GpuHealthSample) -> dict:
    return {name: (_iso(sample.at) if name == "at" else getattr(sample, name)) for name in SAMPLE_FIELDS}


CAPABILITIES = """
SELECT gpus.vendor, f.field, count(*)
FROM gpus
CROSS JOIN LATERAL jsonb_array_elements_text(
    CASE WHEN jsonb_typeof(gpus.health -> 'available') = 'array' THEN gpus.health -> 'available' ELSE '[]' END
) AS f(field)
WHERE gpus.node_id IN ({nodes})
GROUP BY gpus.vendor, f.field
"""


def capability_matrix(principal) -> dict:
    """Per vendor, how many of its (visible) cards report health and how many declared
    each field in their reading's `available`. A vendor none of whose cards reports is
    listed as such ("no_reporting_card"; "no_cards" when there is none at all), never
    as reading zeros."""
    nodes = Node.objects.visible_to(principal)
    counts = {
        row["vendor"]: row
        for row in Gpu.objects.filter(node__in=nodes)
        .values("vendor")
        .annotate(cards=Count("id"), reporting=Count("id", filter=Q(health_at__isnull=False) & ~Q(health={})))
    }
    sql, params = nodes.values("id").query.sql_with_params()
    declared: dict[str, dict[str, int]] = {}
    with connection.cursor() as cursor:
        cursor.execute(CAPABILITIES.format(nodes=sql), params)
        for vendor, field, n in cursor.fetchall():
            if field in CAPABILITY_FIELDS:
                declared.setdefault(vendor, {})[field] = n
    vendors = []
    for vendor, label in GpuVendor.choices:
        row = counts.get(vendor, {"cards": 0, "reporting": 0})
        status = "reports" if row["reporting"] else ("no_reporting_card" if row["cards"] else "no_cards")
        fields = declared.get(vendor, {})
        vendors.append(
            {
                "vendor": vendor,
                "label": label,
                "cards": row["cards"],
                "reporting_cards": row["reporting"],
                "status": status,
                "fields": {name: fields.get(name, 0) for name in CAPABILITY_FIELDS} if row["reporting"] else None,
            }
        )
    return {"fields": list(CAPABILITY_FIELDS), "vendors": vendors}
