"""The one liveness rule (apps/nodes/liveness.py): its Python and SQL halves agree on a grid
of moments around every threshold, on the real PostgreSQL, and nothing else reads the
thresholds."""

import re
from datetime import timedelta
from itertools import product
from pathlib import Path

import pytest
from django.db import connection

from apps.core.clock import utcnow
from apps.nodes import liveness
from apps.nodes.models import Node
from apps.nodes.services import refresh_node_statuses

pytestmark = pytest.mark.django_db(transaction=True)

EPSILON = timedelta(milliseconds=1)


def silences():
    """Each threshold, a hair before and a hair after it, and the far ends."""
    points = {timedelta(0), timedelta(hours=1)}
    for threshold in (liveness.suspect_after(), liveness.give_up_after(), liveness.offline_after()):
        points |= {threshold - EPSILON, threshold, threshold + EPSILON}
    return sorted(points)


# the farewell relative to the last beat: none, before it (an old farewell, then a beat),
# with it (the farewell was the last beat), after it
FAREWELLS = (None, -timedelta(seconds=5), timedelta(0), timedelta(seconds=1))


def seed_grid(now):
    """One node per (silence, executable, farewell), plus never-heard-from nodes."""
    nodes = []
    for number, (silence, executable, farewell) in enumerate(product(silences(), (True, False), FAREWELLS)):
        last = now - silence
        nodes.append(
            Node(
                id=f"n{number}",
                name=f"n{number}",
                executable=executable,
                last_heartbeat_at=last,
                signed_off_at=None if farewell is None else last + farewell,
                # what its last beat wrote: silence is the checker's to judge
                status=liveness.status_at(last, executable, last, None if farewell is None else last + farewell),
            )
        )
    for executable, signed_off_at in product((True, False), (None, now - timedelta(minutes=1))):
        nodes.append(
            Node(
                id=f"never-{executable}-{signed_off_at is not None}",
                name="never",
                executable=executable,
                last_heartbeat_at=None,
                signed_off_at=signed_off_at,
                status="online",
            )
        )
    Node.objects.bulk_create(nodes)
    return nodes


def check_agreement(now):
    nodes = seed_grid(now)
    expected_status = {n.id: liveness.status_at(n.last_heartbeat_at, n.executable, now, n.signed_off_at) for n in nodes}
    expected_given_up = {n.id for n in nodes if liveness.given_up(n.last_heartbeat_at, now)}
    never_heard = {n.id for n in nodes if n.last_heartbeat_at is None}
    assert {"online", "degraded", "suspect", "offline"} == set(expected_status.values())  # the grid spans them all
    assert expected_given_up and expected_given_up != set(expected_status) - never_heard

    with connection.cursor() as cursor:
        # the status CASE (named parameters) and the scheduler's cut-off (positional) are
        # used in separate statements in the code, so they are checked separately here
        cursor.execute(f"SELECT id, {liveness.STATUS_SQL} FROM nodes", liveness.status_params(now))
        sql_status = dict(cursor.fetchall())
        cursor.execute(f"SELECT id FROM nodes WHERE {liveness.not_given_up_sql()}", [liveness.heard_since(now)])
        schedulable_by_silence = {node_id for (node_id,) in cursor.fetchall()}
        cursor.execute(f"SELECT id FROM nodes WHERE {liveness.heard_from_sql()}", [liveness.heard_since(now)])
        heard_by_sql = {node_id for (node_id,) in cursor.fetchall()}
    assert sql_status == expected_status

    # the ORM forms the sweep uses
    assert set(Node.objects.filter(liveness.given_up_q(now)).values_list("pk", flat=True)) == expected_given_up
    heard = set(Node.objects.filter(liveness.heard_from_q(now)).values_list("pk", flat=True))
    assert heard == heard_by_sql == set(expected_status) - expected_given_up - never_heard
    assert schedulable_by_silence == set(expected_status) - expected_given_up

    # the health checker writes what status_at says, and each model agrees
    refresh_node_statuses(now=now)
    stored = {node.pk: node for node in Node.objects.all()}
    assert {pk: node.status for pk, node in stored.items()} == expected_status
    assert all(node.status_at(now) == node.status for node in stored.values())


def test_python_and_sql_agree_on_a_grid_of_moments():
    check_agreement(utcnow())


def test_they_agree_with_other_thresholds_too(settings):
    settings.HETEROFLOW_NODE_STATUS_SUSPECT_SECONDS = 20
    settings.HETEROFLOW_NODE_OFFLINE_SECONDS = 75
    settings.HETEROFLOW_NODE_STATUS_OFFLINE_SECONDS = 90
    check_agreement(utcnow())


def test_a_node_that_signed_off_after_its_last_beat_is_offline():
    now = utcnow()
    last = now - timedelta(seconds=2)
    assert liveness.status_at(last, True, now) == "online"
    assert liveness.status_at(last, True, now, signed_off_at=last) == "offline"
    assert liveness.status_at(last, True, now, signed_off_at=last - timedelta(seconds=10)) == "online"
    node = Node(id="bye", name="bye", last_heartbeat_at=last, signed_off_at=last)
    assert node.status_at(now) == "offline"
    # signing off is not silence: the failure policy still counts on the node
    assert not liveness.given_up(last, now)


def test_between_give_up_and_offline_a_node_shows_suspect_while_given_up():
    """The documented overlap (apps/nodes/liveness.py): the status is a display, given_up
    decides about work."""
    now = utcnow()
    last = now - (liveness.give_up_after() + liveness.offline_after()) / 2
    assert liveness.status_at(last, True, now) == "suspect" and liveness.given_up(last, now)


REPO = Path(__file__).resolve().parents[2]
THRESHOLDS = re.compile(r"HETEROFLOW_NODE_(OFFLINE|STATUS_SUSPECT|STATUS_OFFLINE)_SECONDS")


def test_only_the_liveness_module_reads_the_thresholds():
    readers = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "apps").rglob("*.py")
        if path.name != "liveness.py" and THRESHOLDS.search(re.sub(r"#.*|\"\"\"[\s\S]*?\"\"\"", "", path.read_text()))
    )
    assert readers == []
