"""A declared duration (max_duration_seconds): at most the timeout, or 400 with nothing
written; kept on the task and handed to the agent with it, which stops the task past it
(agent/tests/test_executor_rules.py); a group's members each carry the group's."""

from __future__ import annotations

import pytest

from apps.nodes.models import Node
from apps.tasks.models import Task
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db

JOB = {"name": "sweep", "image": "registry.local/sweep:1", "command": ["python", "sweep.py"], "gpu_required": 1}
GROUP = {"name": "short-ddp", "world_size": 2, "gpus_per_worker": 1, "gpu_type": "nvidia", "image": "trainer:1"}


def test_a_declared_duration_is_kept_and_the_agent_gets_it(api, world):
    key = bearer(world.keys["acme-member"])
    answer = api.post("/api/v1/tasks", JOB | {"max_duration_seconds": 600}, format="json", **key)
    assert answer.status_code == 201, answer.json()
    assert answer.json()["max_duration_seconds"] == 600
    task = Task.objects.get(pk=answer.json()["id"])
    assert task.max_duration_seconds == 600
    Task.objects.filter(pk=task.pk).update(node=Node.objects.create(id="n1", name="n1"))
    seen = api.get(f"/api/v1/tasks/{task.pk}?node_id=n1", **AGENT).json()
    assert seen["max_duration_seconds"] == 600 and seen["timeout_seconds"] >= 600
    plain = api.post("/api/v1/tasks", JOB, format="json", **key).json()
    assert plain["max_duration_seconds"] is None


@pytest.mark.parametrize(
    "changes,problem",
    [
        ({"max_duration_seconds": 601, "timeout_seconds": 600}, "At most the timeout (600 s)"),
        ({"max_duration_seconds": 0}, "greater than or equal to 1"),
        ({"max_duration_seconds": "soon"}, "valid integer"),
    ],
)
def test_a_duration_past_the_timeout_or_not_a_count_is_refused_and_nothing_written(api, world, changes, problem):
    before = Task.objects.count()
    answer = api.post("/api/v1/tasks", JOB | changes, format="json", **bearer(world.keys["acme-member"]))
    assert answer.status_code == 400 and problem in str(answer.json()["error"]["fields"]["max_duration_seconds"])
    assert Task.objects.count() == before


def test_a_groups_members_carry_its_declared_duration(api, world):
    answer = api.post(
        "/api/v1/task-groups", GROUP | {"max_duration_seconds": 900}, format="json", **bearer(world.keys["acme-member"])
    )
    assert answer.status_code == 201, answer.json()
    members = Task.objects.filter(group_id=answer.json()["id"])
    assert members.count() == 2 and {member.max_duration_seconds for member in members} == {900}
