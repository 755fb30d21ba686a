"""POST /api/v1/tasks: what a create does, in one place for both ways in (the DRF view
TaskListView.post, and the thin ASGI route apps.tasks.api.create_route for API keys):
the body validated by TaskCreateSerializer, `submission.submit_task` (tenant, role,
secrets, quota), the task answered as TaskSerializer writes it."""

from __future__ import annotations

import threading

from apps.core.error_codes import CoreErrorCode
from apps.core.errors import Conflict
from apps.tasks.api import serializers as s
from apps.tasks.choices import TaskStatus
from apps.tasks.submission import resubmit_task, submit_task

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


def resubmitted(principal, task, data) -> object:
    """POST /api/v1/tasks/{id}/resubmit and the portal's "resubmit with this change", in
    one place: `data` ({"change": {...}}) checked, the task's submission with the change
    validated as a create, then queued and the task cancelled (submission.resubmit_task).
    The new task. Raises ValidationError (400), PermissionDenied (403) and Conflict (409:
    a group member, or no longer waiting), nothing written on any."""
    body = s.TaskResubmitSerializer(data=data)
    body.is_valid(raise_exception=True)
    change = body.validated_data["change"]
    if task.group_id is not None:
        raise Conflict(
            f"Task {task.pk} is a member of group {task.group_id}: resubmit the group.", CoreErrorCode.INVALID_STATE
        )
    if task.status != TaskStatus.PENDING:
        raise Conflict(f"Task {task.pk} is {task.status}, not waiting; nothing changed.", CoreErrorCode.INVALID_STATE)
    return resubmit_task(principal, task, validated_create(s.submission_of(task, change)), change)
