"""Failure prediction from the ECC history (docs/gpu-health.md#failure-prediction).

Per GPU model, from gpu_health_samples: the cards seen with corrected ECC errors, and of
those how many later became unhealthy (a sample judged unhealthy after the first one
showing corrected errors). A card with corrected errors is given that empirical
fraction as its risk, with the number of cards behind it and a 95% Wilson interval, and
only when the model has at least HETEROFLOW_GPU_HEALTH_PREDICTION_MIN_CARDS such cards;
below that, "not enough data", never a percentage. The spec's caveat holds: the
prediction's validity has not been checked against real failure data, and the fraction
is censored (a card that saw its first corrected error last week has had little time to
fail), so it reads as "so far", not as a probability of failure in a given time.

`failure_statistics` is pure; `model_statistics` reads the history in one query.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from django.conf import settings
from django.db import connection

Z_95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval

NOT_ENOUGH_DATA = "not_enough_data"
ESTIMATE = "estimate"


def wilson_interval(events: int, trials: int, z: float = Z_95) -> tuple[float, float] | None:
    """The Wilson score interval of the fraction events/trials (None without trials):
    unlike the normal approximation it stays inside [0, 1] and is not degenerate at 0
    or at every card."""
    if trials <= 0:
        return None
    p = events / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class ModelStatistics:
    model: str
    vendor: str
    cards_observed: int  # cards of the model with any health sample
    cards_with_corrected: int  # of those, seen with corrected ECC errors (before any unhealthy sample)
    became_unhealthy: int  # of those, judged unhealthy later
    min_cards: int
    status: str  # ESTIMATE or NOT_ENOUGH_DATA
    failure_fraction: float | None  # only with ESTIMATE
    interval_low: float | None
    interval_high: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def failure_statistics(
    model: str, vendor: str, cards_observed: int, with_corrected: int, became_unhealthy: int, min_cards: int
) -> ModelStatistics:
    """One model's figure, or "not enough data" below `min_cards` cards with corrected errors."""
    counts = (model, vendor, cards_observed, with_corrected, became_unhealthy, min_cards)
    if with_corrected < min_cards:
        return ModelStatistics(*counts, NOT_ENOUGH_DATA, None, None, None)
    low, high = wilson_interval(became_unhealthy, with_corrected)
    return ModelStatistics(*counts, ESTIMATE, became_unhealthy / with_corrected, low, high)


# Per card (node and index: the history is keyed so, to outlive a deleted node): when it
# first showed corrected errors and when it was first judged unhealthy. A card already
# unhealthy at (or before) its first corrected sample was bad before there was anything to
# predict from: it is counted as observed, not in the cohort.
STATISTICS = """
WITH cards AS (
    SELECT s.model, max(s.vendor) AS vendor, s.node_id, s.gpu_index,
           min(s.at) FILTER (WHERE COALESCE(s.ecc_corrected_volatile, 0) > 0
                               OR COALESCE(s.ecc_corrected_aggregate, 0) > 0) AS corrected_at,
           min(s.at) FILTER (WHERE s.unhealthy) AS unhealthy_at
    FROM gpu_health_samples AS s
    WHERE {scope}
    GROUP BY s.model, s.node_id, s.gpu_index
)
SELECT model, max(vendor), count(*),
       count(*) FILTER (WHERE corrected_at IS NOT NULL AND (unhealthy_at IS NULL OR unhealthy_at > corrected_at)),
       count(*) FILTER (WHERE corrected_at IS NOT NULL AND unhealthy_at > corrected_at)
FROM cards GROUP BY model ORDER BY model
"""


def model_statistics(node_ids=None) -> list[ModelStatistics]:
    """Every model's statistics, in one query. `node_ids`: a queryset of node ids (values("id"))
    narrowing the history to those nodes (a tenant's visible nodes); None: all of it."""
    params: list = []
    scope = "true"
    if node_ids is not None:
        sql, params = node_ids.query.sql_with_params()
        scope = f"s.node_id IN ({sql})"
    min_cards = settings.HETEROFLOW_GPU_HEALTH_PREDICTION_MIN_CARDS
    with connection.cursor() as cursor:
        cursor.execute(STATISTICS.format(scope=scope), params)
        return [failure_statistics(*row, min_cards) for row in cursor.fetchall()]
