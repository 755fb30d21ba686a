"""Idle interactive tasks (apps.tunnel.idle): stopped after their idle time with their
cards under the threshold and no tunnel session; warned before; a session or a busy card
keeps one, and takes a warning back. On a controlled clock, with the heartbeat's samples
written as the beat writes them."""

from datetime import timedelta

import orjson
import pytest
from django.db import connection

from apps.alerts import keys as alert_keys
from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.scheduler.models import GpuAllocation
from apps.tasks.models import Task
from apps.tenants import services as tenants
from apps.tunnel import idle
from apps.tunnel.models import TunnelSession
from tests.factories import make_node, make_task

pytestmark = pytest.mark.django_db(transaction=True)
NODE = "idle-n1"  # a node no other test beats as


@pytest.fixture
def lab():
    # what other tests leave behind that would read as use: audit rows a live tunnel
    # process wrote after its database was emptied (task ids start again, and an "open"
    # one would name these tasks), and heartbeat samples, which the flush does not empty
    TunnelSession.objects.all().delete()
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM node_metrics WHERE node_id = %s", [NODE])
    tenant = tenants.create_tenant(name="Lab", slug="lab-idle")
    yield tenant
    Task.objects.filter(tenant=tenant).delete()
    tenants.delete_tenant(tenant)


def notebook(tenant, node, started, idle_minutes=30, card=0, **fields):
    task = make_task(
        tenant,
        kind="interactive",
        app="jupyter",
        status="running",
        node=node,
        started_at=started,
        idle_minutes=idle_minutes,
        **fields,
    )
    GpuAllocation.objects.create(task=task, node=node, gpu_index=card, tenant=tenant)
    return task


def sample(node, at, *utilisation):
    gpus = [{"i": index, "u": value} for index, value in enumerate(utilisation)]
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO node_metrics (node_id, at, gpus) VALUES (%s, %s, %s::jsonb)",
            [node.pk, at, orjson.dumps(gpus).decode()],
        )


def warning(task):
    return Alert.objects.filter(key=alert_keys.interactive_idle(task.pk))


def kinds(task):
    return list(task.events.values_list("kind", flat=True))


def test_an_idle_notebook_is_warned_then_stopped_and_a_busy_one_kept(lab):
    now = utcnow()
    node = make_node(NODE, gpus=2)
    started = now - timedelta(minutes=25)
    quiet = notebook(lab, node, started)
    busy = notebook(lab, node, started, card=1)
    for minutes in range(25, 0, -1):  # card 0 idle (2 %), card 1 busy (80 %)
        sample(node, now - timedelta(minutes=minutes), 2.0, 80.0)

    assert idle.sweep(now) == {"stop": 0, "warn": 1, "in_use_again": 0, "none": 1}
    quiet.refresh_from_db()
    assert quiet.idle_warned_at == now and kinds(quiet) == ["idle_warning"]
    alert = warning(quiet).get()
    assert (alert.type, alert.state, alert.severity) == ("INTERACTIVE_IDLE", "ACTIVE", "warning")
    assert alert.task_id == quiet.pk
    assert "will be stopped in about 5 minutes" in alert.message and "under 5 %" in alert.message
    assert idle.sweep(now + timedelta(minutes=1))["warn"] == 0  # warned once

    assert idle.sweep(now + timedelta(minutes=5))["stop"] == 1
    quiet.refresh_from_db()
    assert quiet.status == "stopping" and kinds(quiet) == ["idle_warning", "idle_stopped"]
    assert quiet.events.last().message.startswith("Stopped after 30 minutes idle (no tunnel session")
    assert warning(quiet).get().state == "RECOVERED"
    busy.refresh_from_db()
    assert busy.status == "running" and not warning(busy).exists()  # its card's last busy sample: a minute ago


def test_a_session_keeps_it_and_takes_a_warning_back(lab):
    now = utcnow()
    node = make_node(NODE, gpus=1)
    task = notebook(lab, node, now - timedelta(minutes=28))
    assert idle.sweep(now)["warn"] == 1  # no samples at all: idle since it started
    session = TunnelSession.objects.create(
        task_id=task.pk, node_id=node.pk, principal="alice", kind="port", port=8888, started_at=now
    )
    later = now + timedelta(minutes=10)
    assert idle.sweep(later) == {"stop": 0, "warn": 0, "in_use_again": 1, "none": 0}  # open: in use now
    task.refresh_from_db()
    assert task.idle_warned_at is None and warning(task).get().state == "RECOVERED"
    TunnelSession.objects.filter(pk=session.pk).update(outcome="closed", ended_at=later)
    assert idle.sweep(later + timedelta(minutes=29))["warn"] == 1  # 29 idle minutes since the session: warned
    assert idle.sweep(later + timedelta(minutes=30))["stop"] == 1


def test_only_running_interactive_tasks_with_an_idle_time_are_judged(lab):
    now = utcnow()
    node = make_node(NODE, gpus=2)
    long_ago = now - timedelta(hours=5)
    make_task(lab, status="running", node=node, started_at=long_ago)  # a job
    notebook(lab, node, long_ago, idle_minutes=None)  # no idle time
    ended = notebook(lab, node, long_ago, card=1)
    Task.objects.filter(pk=ended.pk).update(status="stopped")
    assert sum(idle.sweep(now).values()) == 0


def test_a_task_that_ended_meanwhile_is_not_stopped_again(lab, monkeypatch):
    now = utcnow()
    node = make_node(NODE, gpus=1)
    task = notebook(lab, node, now - timedelta(hours=1))
    real = idle.judge

    def ended_while_judged(task, now):
        Task.objects.filter(pk=task.pk).update(status="completed")
        return real(task, now)

    monkeypatch.setattr(idle, "judge", ended_while_judged)
    assert idle.sweep(now)["stop"] == 0
    assert Task.objects.get(pk=task.pk).status == "completed" and kinds(task) == []
