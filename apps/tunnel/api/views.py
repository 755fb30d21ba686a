"""GET /api/v1/tasks/{id}/app: what `hf open` needs to open an interactive task's app
(docs/interactive.md): the app, the task's port it listens on (inside the task, reached
through the tunnel), the path to open and the token the app asks for. Only for those who
may enter the task, while it runs (apps.tunnel.entry: 404, 403, 409)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.error_codes import CoreErrorCode
from apps.core.errors import Conflict
from apps.tasks.choices import InteractiveApp, TaskKind
from apps.tasks.models import Task
from apps.tunnel import entry
from apps.tunnel.api.app_proxy import app_path


class TaskAppView(APIView):
    @extend_schema(
        responses=inline_serializer(
            "TaskApp",
            {
                "app": serializers.CharField(),
                "port": serializers.IntegerField(allow_null=True),
                "path": serializers.CharField(allow_null=True),
                "token": serializers.CharField(allow_null=True),
            },
        )
    )
    def get(self, request, pk):
        try:
            entry.admit(request.auth, pk)
        except entry.Denied as denied:
            return Response(denied.body, status=denied.status)
        task = Task.objects.only("kind", "app", "app_token", "host_port").get(pk=pk)
        if task.kind != TaskKind.INTERACTIVE:
            raise Conflict(
                f"Task {pk} is a {task.kind} task: only interactive tasks have an app "
                "(hf port-forward reaches any port of any task).",
                CoreErrorCode.INVALID_STATE,
            )
        if task.app == InteractiveApp.SHELL:  # nothing to open: a shell, as hf ssh
            return Response({"app": task.app, **dict.fromkeys(("port", "path", "token"))})
        return Response({"app": task.app, "port": task.host_port, "path": app_path(pk), "token": task.app_token})
