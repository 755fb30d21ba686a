"""Alert keys are spelled in one place (apps/alerts/keys.py), in the format stored alerts
already have: a changed key would raise a second active alert for a condition that is
still active."""

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.db import connection

from apps.alerts import keys

REPO = Path(__file__).resolve().parents[2]


def test_the_stored_formats_stay_as_they_were():
    at = datetime(2026, 12, 1, 10, 0, 0, 123456, tzinfo=UTC)
    assert keys.gpu_lost("n1", 3) == "GPU_LOST:n1:3"
    assert keys.node_offline("n1") == "node-offline:n1"
    assert keys.task_failed(412) == "task-failed:412"
    assert keys.task_requeued(412, at) == f"task-requeued:412:{at.timestamp():.3f}"
    assert keys.preemption_timeout(7) == "preemption-timeout:task:7"
    assert keys.quota_exceeded(2) == "quota-exceeded:tenant:2"
    assert keys.SCHEDULER_STALLED == "scheduler-stalled"


@pytest.mark.django_db
def test_the_heartbeats_sql_spells_gpu_lost_the_same_way():
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {keys.gpu_lost_sql('%(id)s', 'i.index')} FROM (SELECT 3 AS index) AS i", {"id": "node-7"}
        )
        assert cursor.fetchone()[0] == keys.gpu_lost("node-7", 3)


# a key built in place: an f-string or literal with a known prefix, or key=f"…"
SPELLED_IN_PLACE = re.compile(
    r"""key\s*=\s*f["']|["'](GPU_LOST:|node-offline:|task-failed:|task-requeued:|preemption-timeout:|"""
    r"""quota-exceeded:|scheduler-stalled)"""
)


def test_no_raiser_spells_a_key_itself():
    spelled = sorted(
        f"{path.relative_to(REPO)}:{number}"
        for path in (REPO / "apps").rglob("*.py")
        if path != REPO / "apps/alerts/keys.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if SPELLED_IN_PLACE.search(line)
    )
    assert spelled == []
