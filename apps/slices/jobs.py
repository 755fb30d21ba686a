"""The slices' periodic jobs, each under the guard (apps.core.guard; beat's schedule is
built from these declarations): the orphan GC and the compensation scan, every 60 s.
Thin: the rules are in apps.slices.services (docs/slices.md)."""

from __future__ import annotations

from apps.core.guard import periodic_job
from apps.slices import services


@periodic_job("slices.gc", every=60)
def gc_job() -> dict:
    """HOLDING slices whose task ended are given back; MIG instances no slice owns are destroyed."""
    return services.gc().as_dict()


@periodic_job("slices.compensate", every=60)
def compensate_job() -> dict:
    """Requests past their deadline time out; half-done transitions are finished."""
    return services.compensate().as_dict()
