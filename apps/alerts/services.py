"""Raising and recovering alerts. Both are idempotent: raising an alert whose key is
already active does nothing; recovering one that is not active does nothing."""

from __future__ import annotations

from django.db import connection

from apps.alerts.sql import RAISE_ALERT_SQL, RECOVER_ALERT_SQL, raise_alert_params


def raise_alert(**fields) -> bool:
    """Returns whether a new alert was created."""
    with connection.cursor() as cursor:
        cursor.execute(RAISE_ALERT_SQL, raise_alert_params(**fields))
        return cursor.rowcount == 1


def recover_alert(key: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(RECOVER_ALERT_SQL, [key])
        return cursor.rowcount == 1
