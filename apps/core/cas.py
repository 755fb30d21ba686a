"""Compare-and-set state transitions: the one way a row's status changes.

The rows still in a source status are locked (`SELECT … WHERE status = ANY(from) FOR
UPDATE`) and updated in one transaction: a racer either wins or loses atomically, the
caller learns which, and a loser changes nothing. Every transition is checked
against the model's allowed-transition table before the database is touched, so an
illegal transition is refused in code, never attempted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from django.db import models, transaction

from apps.core.clock import utcnow


class IllegalTransition(ValueError):
    pass


def check_transition(table: Mapping[str, frozenset[str]], from_statuses: Iterable[str], to_status: str) -> list[str]:
    sources = list(from_statuses)
    if not sources:
        raise IllegalTransition("a transition needs at least one source status")
    illegal = [source for source in sources if to_status not in table.get(source, frozenset())]
    if illegal:
        raise IllegalTransition(f"{', '.join(illegal)} → {to_status} is not an allowed transition")
    return sources


def transition(
    model: type[models.Model],
    table: Mapping[str, frozenset[str]],
    pks,
    from_statuses: Iterable[str],
    to_status: str,
    **changes,
) -> list:
    """Move the rows `pks` (one key or several) from any of `from_statuses` to
    `to_status`, with `changes` written in the same UPDATE. Returns the keys that won."""
    sources = check_transition(table, from_statuses, to_status)
    single = not isinstance(pks, (list, tuple, set, frozenset))
    keys = [pks] if single else list(pks)
    if not keys:
        return []
    fields = {"status": to_status, **changes}
    if any(field.name == "updated_at" for field in model._meta.concrete_fields) and "updated_at" not in fields:
        fields["updated_at"] = utcnow()
    with transaction.atomic():
        # FOR UPDATE re-checks the status after waiting for a concurrent writer
        # (PostgreSQL re-evaluates the WHERE on the row it committed), so of two racers
        # exactly one sees the source status.
        updated = list(
            model.objects.select_for_update()
            .filter(pk__in=keys, status__in=sources)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        if updated:
            model.objects.filter(pk__in=updated).update(**fields)
    return updated
