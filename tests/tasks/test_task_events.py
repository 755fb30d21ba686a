"""Task events are written in one place (apps.tasks.services: task_event, record_event,
record_events), whoever writes them: the API, requeues, the failure policy."""

import re
from pathlib import Path

import pytest

from apps.tasks.models import TaskEvent
from apps.tasks.services import record_event, record_events, task_event
from tests.factories import TaskFactory

REPO = Path(__file__).resolve().parents[2]
WRITES_AN_EVENT = re.compile(r"(?<!class )TaskEvent\(|TaskEvent\.objects\.(create|bulk_create|get_or_create)")


@pytest.mark.django_db
def test_one_and_many_events_are_shaped_the_same_way(world):
    task = TaskFactory(tenant=world.tenants["acme"], image="x")
    one = record_event(task, kind="requeued", message="m" * 3000)
    many = record_events(task_event(task.pk, kind="node_lost_pending", message="n" * 3000) for _ in range(2))
    assert len(one.message) == 2000 and one.details == {} and one.task is task
    assert [len(event.message) for event in many] == [2000, 2000]
    assert TaskEvent.objects.filter(task=task).count() == 3


def test_no_other_module_writes_task_events_itself():
    writers = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "apps").rglob("*.py")
        if path != REPO / "apps/tasks/services.py" and WRITES_AN_EVENT.search(path.read_text())
    )
    assert writers == []
