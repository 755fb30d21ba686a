"""Tunnel jobs: stopping idle interactive tasks (apps.tunnel.idle)."""

from __future__ import annotations

from django.conf import settings

from apps.core.guard import periodic_job
from apps.tunnel import idle

reclaim_idle_job = periodic_job("tunnel.reclaim_idle", every=settings.HETEROFLOW_INTERACTIVE_RECLAIM_SECONDS)(
    idle.sweep
)
