"""The raise/recover statements, shared by the ORM side and the async hot paths so that
de-duplication is defined once: at most one ACTIVE alert per key."""

import json

RAISE_ALERT_SQL = """
    INSERT INTO alerts (type, severity, state, key, node_id, gpu_index, tenant_id, message, details, created_at, updated_at)
    VALUES (%s, %s, 'ACTIVE', %s, %s, %s, %s, %s, %s::jsonb, now(), now())
    ON CONFLICT (key) WHERE state = 'ACTIVE' DO NOTHING
"""
RECOVER_ALERT_SQL = "UPDATE alerts SET state = 'RECOVERED', ended_at = now(), updated_at = now() WHERE key = %s AND state = 'ACTIVE'"


def raise_alert_params(*, type, severity, key, message, node_id="", gpu_index=None, tenant_id=None, details=None) -> list:
    return [str(type), str(severity), key, node_id, gpu_index, tenant_id, message, json.dumps(details or {})]
