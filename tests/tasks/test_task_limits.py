"""What one task may ask for (at most MAX_GPUS_PER_TASK GPUs, a priority from
MIN_PRIORITY to MAX_PRIORITY) is written once, in apps/tasks/choices.py, and every way of
describing a task keeps to it: a task, a group's worker, an inference service's replica,
and the thin create route, which validates with the task's serializer."""

import ast

import pytest
from rest_framework.exceptions import ValidationError

from apps.inference.api.serializers import ServiceCreateSerializer
from apps.tasks.api.create import validated_create
from apps.tasks.api.serializers import TaskCreateSerializer, TaskGroupCreateSerializer
from apps.tasks.choices import DEFAULT_PRIORITY, MAX_GPUS_PER_TASK, MAX_PRIORITY, MIN_PRIORITY
from tests.spelling import name_of, sources, tree

HOME = "apps/tasks/choices.py"


def test_the_limits_stay_as_they_were():
    assert (MAX_GPUS_PER_TASK, MIN_PRIORITY, MAX_PRIORITY, DEFAULT_PRIORITY) == (64, 0, 100, 50)


@pytest.mark.parametrize(
    ("serializer", "gpus"),
    [
        (TaskCreateSerializer, "gpu_required"),
        (TaskGroupCreateSerializer, "gpus_per_worker"),
        (ServiceCreateSerializer, "gpus_per_replica"),
    ],
)
def test_every_way_of_describing_a_task_keeps_to_the_limits(serializer, gpus):
    fields = serializer().fields
    assert fields[gpus].max_value == MAX_GPUS_PER_TASK
    priority = fields["priority"]
    assert (priority.min_value, priority.max_value, priority.default) == (MIN_PRIORITY, MAX_PRIORITY, DEFAULT_PRIORITY)


@pytest.mark.parametrize(
    "asked", [{"gpu_required": MAX_GPUS_PER_TASK + 1}, {"priority": MAX_PRIORITY + 1}, {"priority": MIN_PRIORITY - 1}]
)
def test_the_create_route_refuses_what_the_serializer_refuses(asked):
    with pytest.raises(ValidationError) as refused:
        validated_create({"name": "t", "image": "busybox", **asked})
    assert set(refused.value.detail) == set(asked)


def limit_copies(module: ast.Module, name: str) -> list[str]:
    """A task's priority field (bounded by MAX_PRIORITY) whose bounds or default, or a
    GPU count whose maximum, is a number written in place. (A gateway route's priority is
    another thing, with other bounds.)"""
    copies = []
    for node in ast.walk(module):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        field = next((target.id for target in node.targets if isinstance(target, ast.Name)), "")
        keywords = {keyword.arg: keyword.value for keyword in node.value.keywords}
        bound = keywords.get("max_value")
        task_priority = field == "priority" and (
            getattr(bound, "id", None) == "MAX_PRIORITY" or getattr(bound, "value", None) == MAX_PRIORITY
        )
        for arg, value in keywords.items():
            if not isinstance(value, ast.Constant):
                continue
            gpus = field.startswith("gpu") and arg == "max_value" and value.value == MAX_GPUS_PER_TASK
            if gpus or (task_priority and arg in ("min_value", "max_value", "default")):
                copies.append(f"{name}:{node.lineno}: {field} {arg}={value.value}")
    return copies


def test_no_serializer_spells_the_limits_itself():
    copies = [copy for path in sources() if name_of(path) != HOME for copy in limit_copies(tree(path), name_of(path))]
    assert copies == []


def test_the_check_sees_a_copy():
    copy = ast.parse(
        "class S:\n"
        "    gpus_per_replica = serializers.IntegerField(min_value=1, max_value=64, default=1)\n"
        "    priority = serializers.IntegerField(min_value=0, max_value=MAX_PRIORITY, default=50)\n"
        "    weight = serializers.IntegerField(min_value=0, max_value=100)\n"
        "    priority = serializers.IntegerField(min_value=0, max_value=32767, default=0)\n"
    )
    assert limit_copies(copy, "s.py") == [
        "s.py:2: gpus_per_replica max_value=64",
        "s.py:3: priority min_value=0",
        "s.py:3: priority default=50",
    ]
