"""Raising and recovering alerts. Both are idempotent: the alerts table allows one
ACTIVE alert per key, so raising an active key does nothing, and recovering an alert
that is not active does nothing. (The heartbeat raises GPU_LOST inside its own single
statement, relying on the same index.)"""

from __future__ import annotations

from apps.alerts.choices import AlertState
from apps.alerts.models import Alert
from apps.core.clock import utcnow

RAISE_SQL = """
    INSERT INTO alerts (type, severity, state, key, node_id, gpu_index, tenant_id, message, details, created_at, updated_at)
    VALUES (%s, %s, 'ACTIVE', %s, %s, %s, %s, %s, %s::jsonb, now(), now())
    ON CONFLICT (key) WHERE state = 'ACTIVE' DO NOTHING
"""


def raise_alert(*, type, severity, key, message, node_id="", gpu_index=None, tenant_id=None, details=None) -> bool:
    """Returns whether a new alert was created."""
    import json

    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(RAISE_SQL, [str(type), str(severity), key, node_id, gpu_index, tenant_id, message, json.dumps(details or {})])
        return cursor.rowcount == 1


def recover_alert(key: str) -> bool:
    now = utcnow()
    return bool(
        Alert.objects.filter(key=key, state=AlertState.ACTIVE).update(state=AlertState.RECOVERED, ended_at=now, updated_at=now)
    )
