"""POST /api/v1/tasks: what a create does, in one place for both ways in (the DRF view
TaskListView.post, and the thin ASGI route apps.tasks.api.create_route for API keys):
the body validated by TaskCreateSerializer, `submission.submit_task` (tenant, role,
secrets, quota), the task answered as TaskSerializer writes it."""

from __future__ import annotations

import threading

from apps.tasks.api import serializers as s
from apps.tasks.submission import submit_task

_serializers = threading.local()


def validated_create(data) -> dict:
    """TaskCreateSerializer(data=data).is_valid(raise_exception=True) and its
    validated_data, on a serializer kept per thread: DRF copies a serializer's declared
    fields for every new instance, a millisecond per create for this one."""
    serializer = getattr(_serializers, "create", None)
    if serializer is None:
        serializer = _serializers.create = s.TaskCreateSerializer(data=None)
    for answer in ("_validated_data", "_errors", "_data"):
        serializer.__dict__.pop(answer, None)
    serializer.initial_data = data
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


def task_body(task) -> dict:
    """TaskSerializer(task).data, on a serializer kept per thread (its fields are built
    from the model once, not per task)."""
    serializer = getattr(_serializers, "task", None)
    if serializer is None:
        serializer = _serializers.task = s.TaskSerializer()
    return serializer.to_representation(task)


def create_task_answer(principal, data) -> dict:
    """Queue the task `data` describes for `principal`; its body as the API answers
    201. Raises what the API answers otherwise: ValidationError (400),
    PermissionDenied (403), Http404, Conflict (409, quota exceeded)."""
    return task_body(submit_task(principal, validated_create(data)))
