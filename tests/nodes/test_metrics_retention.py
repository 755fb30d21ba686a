from datetime import timedelta

import pytest
from django.db import connection

from apps.core.clock import utcnow
from apps.nodes.metrics import NODE_METRICS, prune_and_prepare_partitions

pytestmark = pytest.mark.django_db(transaction=True)


def partitions():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = 'node_metrics'"
        )
        return {row[0] for row in cursor.fetchall()}


def test_retention_drops_whole_partitions_and_prepares_the_coming_days(settings):
    settings.METRICS_RETENTION_HOURS = 48
    now = utcnow()
    later = now + timedelta(days=5)
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO node_metrics (node_id, at, gpus) VALUES ('n', %s, '[]')", [now])
        # a sample that arrived with a wild clock lands in the default partition
        cursor.execute(
            "INSERT INTO node_metrics (node_id, at, gpus) VALUES ('n', %s, '[]')", [now - timedelta(days=400)]
        )
    result = prune_and_prepare_partitions(now=later)
    assert NODE_METRICS.partition_name(now.date()) in result["dropped"]
    assert NODE_METRICS.partition_name((later + timedelta(days=3)).date()) in partitions()
    assert NODE_METRICS.partition_name(later.date()) in partitions()
    with connection.cursor() as cursor:
        # this test's node only: the fault tests' fleets leave rows of their own (the table
        # is not a model's, so a transactional test's flush does not empty it)
        cursor.execute("SELECT count(*) FROM node_metrics WHERE node_id = 'n'")
        assert cursor.fetchone()[0] == 0
    # running it again changes nothing
    assert prune_and_prepare_partitions(now=later) == {"created": [], "dropped": []}
