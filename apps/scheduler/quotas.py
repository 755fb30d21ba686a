"""Queues' store (docs/queues.md): each tenant's nominal cards per GPU type, its cohort and its
fair-share weight, as operators set them; the cards each tenant holds now; and the
decayed usage above nominal that orders borrowers. The scheduler's core decides with
them (apps.scheduler.core.queues); this module writes and reads them.

Writes: `set_queue` (one tenant's queue, in one transaction: the queue row, then its
quota rows) and `account_usage` (the periodic job's: every queue row, in tenant id
order, `FOR UPDATE SKIP LOCKED`, so an operator's edit in progress is accounted on the
next run). Nothing else writes these tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import connection, transaction

from apps.confidential.services import record_audit
from apps.scheduler.core.queues import QueueBook, QueueSpec, Quota, decayed, fair_order
from apps.scheduler.ledger import card_share_sql
from apps.tenants.models import Cohort, QueueQuota, Tenant, TenantQueue


@dataclass(frozen=True)
class QuotaInput:
    gpu_type: str
    nominal: int
    borrowing_limit: int | None = None
    lending_limit: int | None = None


def half_life_seconds() -> float:
    return settings.HETEROFLOW_FAIR_SHARE_HALF_LIFE_DAYS * 86400.0


# --- writing ------------------------------------------------------------------------------


def set_queue(
    tenant: Tenant, *, cohort: str | None, weight: float, quotas: Sequence[QuotaInput], principal=None
) -> list[str]:
    """Replace the tenant's queue with the one given (checked by the API's serializer).
    A cohort named for the first time is created. Returns warnings, in words: a cohort
    whose members' nominal of a type passes the fleet's cards of that type is allowed
    (not every member needs its nominal at once) but said."""
    with transaction.atomic():
        group = Cohort.objects.get_or_create(name=cohort)[0] if cohort else None
        queue, _ = TenantQueue.objects.select_for_update().get_or_create(tenant=tenant)
        queue.cohort, queue.weight = group, weight
        queue.save(update_fields=["cohort", "weight", "updated_at"])
        QueueQuota.objects.filter(queue=queue).exclude(gpu_type__in=[quota.gpu_type for quota in quotas]).delete()
        for quota in sorted(quotas, key=lambda q: q.gpu_type):
            QueueQuota.objects.update_or_create(
                queue=queue,
                gpu_type=quota.gpu_type,
                defaults={
                    "nominal": quota.nominal,
                    "borrowing_limit": quota.borrowing_limit,
                    "lending_limit": quota.lending_limit,
                },
            )
        record_audit(
            tenant,
            principal,
            "queue.updated",
            tenant.slug,
            cohort=cohort or "",
            weight=str(weight),
            quotas=", ".join(f"{q.gpu_type}={q.nominal}" for q in quotas),
        )
    return overbooked(cohort) if cohort else []


def remove_queue(tenant: Tenant, *, principal=None) -> bool:
    with transaction.atomic():
        deleted, _ = TenantQueue.objects.filter(tenant=tenant).delete()
        if deleted:
            record_audit(tenant, principal, "queue.removed", tenant.slug)
    return bool(deleted)


FLEET_CARDS = """
    SELECT g.vendor, count(*) FROM gpus AS g JOIN nodes AS n ON n.id = g.node_id
    WHERE g.lost_at IS NULL AND n.status <> 'offline' GROUP BY g.vendor
"""


def fleet_cards() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(FLEET_CARDS)
        return dict(cursor.fetchall())


def overbooked(cohort: str) -> list[str]:
    sums: dict[str, int] = {}
    for gpu_type, nominal in QueueQuota.objects.filter(queue__cohort__name=cohort).values_list("gpu_type", "nominal"):
        sums[gpu_type] = sums.get(gpu_type, 0) + nominal
    cards = fleet_cards()
    return [
        f"The cohort {cohort}'s nominal {gpu_type} cards add up to {total}, more than the "
        f"{cards.get(gpu_type, 0)} {gpu_type} cards in the fleet: not every member gets its nominal at once."
        for gpu_type, total in sorted(sums.items())
        if total > cards.get(gpu_type, 0)
    ]


# --- reading (the scheduler's cycle, the API, the pages) ----------------------------------

HOLDINGS = f"""
    SELECT a.tenant_id, g.vendor, sum({card_share_sql("a", "g")})
    FROM gpu_allocations AS a JOIN gpus AS g ON g.node_id = a.node_id AND g.index = a.gpu_index
    GROUP BY a.tenant_id, g.vendor
"""

SPECS = """
    SELECT q.tenant_id, t.slug, c.name, q.weight, q.usage_above_nominal, q.usage_at,
           COALESCE(json_agg(json_build_array(qq.gpu_type, qq.nominal, qq.borrowing_limit, qq.lending_limit))
                    FILTER (WHERE qq.id IS NOT NULL), '[]')
    FROM tenant_queues AS q JOIN tenants AS t ON t.id = q.tenant_id
    LEFT JOIN cohorts AS c ON c.id = q.cohort_id
    LEFT JOIN queue_quotas AS qq ON qq.queue_id = q.tenant_id
    GROUP BY q.tenant_id, t.slug, c.name, q.weight, q.usage_above_nominal, q.usage_at
"""


def _as_json(value):
    import orjson  # noqa: PLC0415  (psycopg gives json as text only without its loader)

    return orjson.loads(value) if isinstance(value, (str, bytes)) else value


def holdings() -> dict[tuple[int, str], float]:
    """The cards each tenant holds now, per GPU type, a shared card as its share (the
    ledger: tasks, group members and inference replicas alike)."""
    with connection.cursor() as cursor:
        cursor.execute(HOLDINGS)
        return {(tenant_id, vendor): float(cards) for tenant_id, vendor, cards in cursor.fetchall()}


def queue_book(now: datetime, used: dict[tuple[int, str], float] | None = None) -> QueueBook:
    """Every queue, what each tenant holds (`used`, or read from the ledger) and its usage
    above nominal decayed to `now`: what the core decides with. Two queries."""
    specs, history = [], {}
    with connection.cursor() as cursor:
        cursor.execute(SPECS)
        rows = cursor.fetchall()
    for tenant_id, slug, cohort, weight, usage, usage_at, quotas in rows:
        specs.append(
            QueueSpec(
                tenant_id,
                slug,
                cohort,
                weight,
                {gpu_type: Quota(nominal, borrow, lend) for gpu_type, nominal, borrow, lend in _as_json(quotas)},
            )
        )
        elapsed = (now - usage_at).total_seconds() if usage_at else 0.0
        history[tenant_id] = decayed(usage, elapsed, half_life_seconds())
    return QueueBook(specs, holdings() if used is None else used, history)


@dataclass(frozen=True)
class TypeUse:
    gpu_type: str
    nominal: float
    used: float
    borrowed: float
    lent: float
    borrowing_limit: float | None
    lending_limit: float | None


def tenant_view(book: QueueBook, tenant_id: int) -> dict:
    """A tenant's queue as its people and operators see it: per type its nominal, what it
    uses, borrows and lends; its place in the fair-share order; its decayed usage."""
    spec = book.specs.get(tenant_id)
    if spec is None:
        return {"queue": None}
    types = sorted(set(spec.quotas) | {gpu_type for (owner, gpu_type) in book.used if owner == tenant_id})
    rows = []
    for gpu_type in types:
        quota = spec.quota(gpu_type)
        used = book.holds(tenant_id, gpu_type)
        rows.append(
            TypeUse(
                gpu_type,
                quota.nominal,
                round(used, 3),
                round(book.above_nominal(tenant_id, gpu_type), 3),
                round(_lent(book, spec, gpu_type), 3),
                quota.borrowing_limit,
                quota.lending_limit,
            ).__dict__
        )
    peers = [s.tenant_id for s in book.cohorts.get(spec.cohort, ())] if spec.cohort else [tenant_id]
    order = fair_order(book, peers)
    return {
        "tenant": spec.name,
        "cohort": spec.cohort,
        "weight": spec.weight,
        "usage_above_nominal_gpu_hours": round(book.history.get(tenant_id, 0.0) / 3600.0, 3),
        "dominant_share": round(book.dominant_share(tenant_id), 3),
        "fair_share_place": order.index(tenant_id) + 1,
        "fair_share_of": len(order),
        "types": rows,
    }


def _lent(book: QueueBook, spec: QueueSpec, gpu_type: str) -> float:
    """What of the tenant's idle nominal its cohort's borrowers use now: the cohort's
    borrowing, spread over its lenders in proportion to what each lends."""
    if not spec.cohort:
        return 0.0
    borrowed = book.cohort_borrowed(spec.cohort, gpu_type)
    lendable = book.cohort_lendable(spec.cohort, gpu_type)
    mine = book.idle_lendable(spec, gpu_type)
    if borrowed <= 0 or lendable <= 0:
        return 0.0
    return min(mine, borrowed * mine / lendable)


# --- the usage ledger (the scheduler.queue_usage job) --------------------------------------

LOCK_QUEUES = """
    SELECT tenant_id, usage_above_nominal, usage_at FROM tenant_queues
    ORDER BY tenant_id FOR UPDATE SKIP LOCKED
"""
WRITE_USAGE = """
    UPDATE tenant_queues AS q SET usage_above_nominal = v.usage, usage_at = %s
    FROM unnest(%s::bigint[], %s::float8[]) AS v(tenant_id, usage) WHERE q.tenant_id = v.tenant_id
"""


def account_usage(now: datetime) -> int:
    """Add each queue's cards above nominal since its last accounting (as held now) to its
    decayed usage. Returns how many queues it accounted."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(LOCK_QUEUES)
        rows = cursor.fetchall()
        if not rows:
            return 0
        book = queue_book(now)
        ids, usages = [], []
        for tenant_id, usage, usage_at in rows:
            spec = book.specs.get(tenant_id)
            elapsed = (now - usage_at).total_seconds() if usage_at else 0.0
            above = sum(book.above_nominal(tenant_id, gpu_type) for gpu_type in _types(book, spec))
            ids.append(tenant_id)
            usages.append(decayed(usage, elapsed, half_life_seconds()) + above * max(elapsed, 0.0))
        cursor.execute(WRITE_USAGE, [now, ids, usages])
    return len(ids)


def _types(book: QueueBook, spec: QueueSpec | None) -> set[str]:
    if spec is None:
        return set()
    return set(spec.quotas) | {gpu_type for (owner, gpu_type) in book.used if owner == spec.tenant_id}
