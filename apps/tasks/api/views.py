from datetime import timedelta

from django.conf import settings
from django.db import connections
from django.db.models import Q
from django.http import StreamingHttpResponse
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import generics, serializers, status
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.alerts.failures import LOST_RUN_STATUSES, Verdict, adjudicate_lost_runs
from apps.core.cas import IllegalTransition
from apps.core.clock import utcnow
from apps.core.error_codes import CoreErrorCode
from apps.core.errors import Conflict
from apps.core.renderers import EventStreamRenderer, FastJSONRenderer
from apps.core.views import ScopedAPIView
from apps.nodes.metrics import card_series
from apps.tasks import log_stream, logs, services
from apps.tasks.api import serializers as s
from apps.tasks.api.create import create_task_answer, resubmitted
from apps.tasks.choices import TERMINAL, GroupPlacement, TaskKind
from apps.tasks.error_codes import TaskErrorCode
from apps.tasks.models import Task, TaskGroup, TaskLogState
from apps.tasks.ranks import wiring_env
from apps.tasks.selectors import (
    agent_tasks,
    task_group_detail,
    task_group_events,
    task_group_list,
    task_list,
    task_slice,
    task_stats,
)
from apps.tasks.submission import submit_array, submit_group
from apps.tenants import policy


class PeopleOrAgent(BasePermission):
    """People everywhere here; the agent key only on its channel: GET the list (with
    node_id and status) and PUT a task (a CAS report)."""

    message = "The agent key can only fetch a node's tasks and report on them."

    def has_permission(self, request, view):
        principal = request.auth
        if principal is None:
            return False
        if principal.is_agent:
            return request.method in getattr(view, "agent_methods", ())
        if request.method in getattr(view, "agent_only_methods", ()):
            return False
        return principal.is_operator or principal.is_tenant


def agent_task(task: Task) -> dict:
    env, missing = services.resolve_env(task)
    data = s.TaskSerializer(task).data
    data["env"] = env | wiring_env(task)  # a group member's rank variables: the task's own env never wins
    data["registry_auth"] = services.resolve_registry_auth(task)
    if task.registry_auth and data["registry_auth"] is None:
        missing = [*missing, task.registry_auth["password"]["secret"]]
    # the cards it holds, for the vendor's visibility variable (NVIDIA_VISIBLE_DEVICES, …)
    data["gpu_indices"] = sorted(task.allocations.values_list("gpu_index", flat=True))
    data["slice"] = task_slice(task)  # a memory-only task's: the agent starts it only once confirmed
    if services.in_gang(task):  # echoed in the agent's reports (services.late_group_report)
        data["attempt"] = task.group.attempts
    if task.kind == TaskKind.INTERACTIVE:
        data["app_token"] = task.app_token  # the app asks for it (the agent passes it in the environment)
        if not data["image"]:
            data["image"] = interactive_image(task)
    if missing:
        data["missing_secrets"] = missing
    return data


def interactive_image(task: Task) -> str:
    """The image an interactive task that names none starts in on its node: the one the
    operator set for the node's vendor, else their default (HETEROFLOW_INTERACTIVE_IMAGES)."""
    images = settings.HETEROFLOW_INTERACTIVE_IMAGES
    vendor = task.node.gpus.values_list("vendor", flat=True).first() if task.node_id else None
    return images.get(vendor or "", images.get("default", ""))


class TaskListView(generics.ListAPIView):
    permission_classes = [PeopleOrAgent]
    agent_methods = ("GET",)
    serializer_class = s.TaskSerializer

    def get_queryset(self):
        filters = {name: self.params[name] for name in ("status", "kind", "node_id") if name in self.params}
        tasks = task_list(self.request.auth, **filters)
        if self.params.get("active"):
            tasks = tasks.exclude(status__in=TERMINAL)
        return tasks.order_by("-created_at", "-id") if self.params["ordering"] == "newest" else tasks.in_queue_order()

    @extend_schema(parameters=[s.TaskListQuerySerializer])
    def get(self, request, *args, **kwargs):
        serializer = s.TaskListQuerySerializer(data=request.query_params.dict())
        serializer.is_valid(raise_exception=True)
        self.params = serializer.validated_data
        if request.auth.is_agent:
            missing = [name for name in ("node_id", "status") if name not in self.params]
            if missing:
                raise ValidationError({name: ["The agent key must name the node and the status."] for name in missing})
            if self.params.get("limit", 0) > s.AGENT_MAX_LIMIT:
                raise ValidationError({"limit": [f"Ensure this value is less than or equal to {s.AGENT_MAX_LIMIT}."]})
            tasks = (
                agent_tasks(self.params["node_id"], self.params["status"])
                .select_related("tenant", "created_by", "group")
                .in_queue_order()[: self.params.get("limit", s.AGENT_DEFAULT_LIMIT)]
            )
            return Response({"results": [agent_task(task) for task in tasks]})
        return super().get(request, *args, **kwargs)

    @extend_schema(request=s.TaskCreateSerializer, responses={201: s.TaskSerializer})
    def post(self, request):
        # requests with an API key come in by apps.tasks.api.create_route, to the same code
        return Response(create_task_answer(request.auth, request.data), status=status.HTTP_201_CREATED)


class TaskBatchView(APIView):
    """Many tasks in one request: an array (s.TaskArraySerializer), all or none."""

    @extend_schema(request=s.TaskArraySerializer, responses={201: s.TaskBatchCreatedSerializer})
    def post(self, request):
        serializer = s.TaskArraySerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        tasks = submit_array(request.auth, serializer.validated_data)
        return Response({"count": len(tasks), "ids": [task.pk for task in tasks]}, status=status.HTTP_201_CREATED)


class TaskView(ScopedAPIView):
    """One task by the id in its URL, among those the caller may see (404 otherwise). The
    agent key finds its node's tasks by node instead (it sees no task through the scope)."""

    queryset = Task.objects.all()


class TaskDetailView(TaskView):
    permission_classes = [PeopleOrAgent]
    agent_methods = ("GET", "PUT")
    agent_only_methods = ("PUT",)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "node_id",
                str,
                description="The agent key only, required: the node asking. "
                "A task not (or no longer) on that node is 404, which tells the agent to stop it.",
            )
        ],
        responses=s.TaskDetailSerializer,
    )
    def get(self, request, pk):
        if request.auth.is_agent:
            node_id = request.query_params.get("node_id")
            if not node_id:
                raise ValidationError({"node_id": ["The agent key must name the node."]})
            return Response(agent_task(get_object_or_404(Task, pk=pk, node_id=node_id)))
        return Response(s.TaskDetailSerializer(self.get_object()).data)

    @extend_schema(request=s.AgentReportSerializer, responses=s.TaskSerializer)
    def put(self, request, pk):
        """The agent's report: a CAS from the status it saw. 409 when it lost, which is
        also what a retried terminal report gets: nothing changes twice."""
        serializer = s.AgentReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        # a task sent back to the queue (preemption confirmed, or forced) has left its
        # node: the retried confirmation must still learn that it lost (409), not 404;
        # so must a gang group's member placed elsewhere since (its attempt here ended); a
        # replica of an inference service answers as a single task (404 from another node)
        task = get_object_or_404(
            Task.objects.filter(
                Q(node_id=data["node_id"]) | Q(node__isnull=True) | Q(group__placement=GroupPlacement.GANG)
            ).select_related("group"),
            pk=pk,
        )
        late = services.late_group_report(task, data["node_id"], attempt=data["attempt"])
        if late:
            raise Conflict(late, TaskErrorCode.ATTEMPT_ENDED)
        try:
            won = services.agent_report(
                task,
                from_status=data["from_status"],
                to_status=data["status"],
                exit_code=data["exit_code"],
                error_message=data["error_message"],
                log_tail=data["log_tail"],
            )
        except IllegalTransition as exc:
            raise ValidationError({"status": [str(exc)]}) from None
        task.refresh_from_db()
        late = not won and services.late_group_report(task, data["node_id"], lost=True)
        if late:
            raise Conflict(late, TaskErrorCode.ATTEMPT_ENDED)
        if not won:
            raise Conflict(
                f"Task {task.pk} is {task.status}, not {data['from_status']}; nothing changed.",
                CoreErrorCode.STATUS_CHANGED,
            )
        return Response(s.TaskSerializer(task).data)


class TaskStopView(TaskView):
    @extend_schema(request=None, responses=s.TaskSerializer)
    def post(self, request, pk):
        task = self.get_object()
        policy.check_may_stop_task(request.auth, task)
        return Response(s.TaskSerializer(services.stop_task(task)).data)


class TaskResubmitView(TaskView):
    """A waiting task queued again with a change (one of explain's suggestions), and
    cancelled: both or neither; each records the other in its events."""

    @extend_schema(request=s.TaskResubmitSerializer, responses={201: s.TaskSerializer})
    def post(self, request, pk):
        new = resubmitted(request.auth, self.get_object(), request.data)
        return Response(s.TaskSerializer(new).data, status=status.HTTP_201_CREATED)


class TaskStatsView(APIView):
    @extend_schema(
        responses=inline_serializer(
            "TaskStats",
            {
                "total": serializers.IntegerField(),
                "by_status": serializers.DictField(child=serializers.IntegerField()),
                "gpus_held": serializers.IntegerField(),
                "gpu_seconds_settled": serializers.FloatField(help_text="GPU time of the tasks that ended"),
            },
        )
    )
    def get(self, request):
        return Response(task_stats(request.auth))


LOG_RENDERERS = [FastJSONRenderer, EventStreamRenderer]


class LogView:
    """A log view answers a page as JSON and a follow as an event stream; anything else it
    answers (an error, a page asked for with `format=event-stream` but no follow) is JSON,
    whatever the client accepted."""

    renderer_classes = LOG_RENDERERS

    def finalize_response(self, request, response, *args, **kwargs):
        if isinstance(response, Response) and getattr(request, "accepted_renderer", None) is not None:
            request.accepted_renderer, request.accepted_media_type = FastJSONRenderer(), "application/json"
        return super().finalize_response(request, response, *args, **kwargs)


def log_responses(serializer) -> dict:
    return {(200, "application/json"): serializer, (200, "text/event-stream"): OpenApiTypes.STR}


class TaskMetricsView(TaskView):
    """The readings of the cards the task holds (utilisation, memory, power,
    temperature), from the heartbeats' samples of its node over `window`, from when it
    started: what `hf top` shows and the task page draws. A task that holds no card (not
    placed, ended) has none."""

    @extend_schema(parameters=[s.TaskMetricsQuerySerializer], responses=s.TaskMetricsSerializer)
    def get(self, request, pk):
        window = query(s.TaskMetricsQuerySerializer, request)["window"]
        task = self.get_object()
        indices = sorted(task.allocations.values_list("gpu_index", flat=True))
        now = utcnow()
        since = max(filter(None, (now - timedelta(seconds=window), task.started_at)))
        step, samples = (0, [])
        if indices and task.node_id:
            step, samples = card_series(task.node_id, indices, since, now)
        return Response(
            {
                "task": task.pk,
                "status": task.status,
                "node_id": task.node_id,
                "gpu_indices": indices,
                "window_seconds": window,
                "bucket_seconds": step,
                "samples": samples,
            }
        )


class TaskLogsView(LogView, TaskView):
    """The task's live log (apps.tasks.logs): a page of lines after `after`, the last
    `tail`, or with `follow=true` a text/event-stream of them until the task ends
    (apps.tasks.log_stream; Last-Event-ID goes on after the last line a client got).
    `Accept: text/event-stream` alone asks for the stream too."""

    @extend_schema(parameters=[s.TaskLogsQuerySerializer], responses=log_responses(s.TaskLogsSerializer))
    def get(self, request, pk):
        params = query(s.TaskLogsQuerySerializer, request)
        task = self.get_object()
        if follows(request, params):
            after = resume_point(request, params["after"])
            if after is None:
                after = tail_start(task.pk, params) if "tail" in params else params["after"]
            return event_stream(log_stream.follow([log_stream.Member(task.pk, None, after)]))
        lines = logs.read_page(
            task.pk, after=params["after"], tail=params.get("tail"), since=params.get("since"), limit=params["limit"]
        )
        state = logs_state(task.pk)
        return Response(
            {
                "task_id": task.pk,
                "status": task.status,
                "exit_code": task.exit_code,
                "lines": lines,
                "next": lines[-1]["seq"] if lines else params["after"],
                "first": state.first_seq if state else 1,
                "dropped_bytes": state.dropped_bytes if state else 0,
                "log_tail": task.log_tail,
            }
        )


def query(serializer_class, request) -> dict:
    serializer = serializer_class(data=request.query_params.dict())
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


def follows(request, params: dict) -> bool:
    return params["follow"] or request.accepted_renderer.format == EventStreamRenderer.format


def resume_point(request, after: int) -> int | None:
    """Where a reconnecting follower goes on: its Last-Event-ID (the last line it got)."""
    last = (request.headers.get("Last-Event-ID") or "").strip()
    return int(last) if last.isdigit() else (after if after > 0 else None)


def tail_start(task_id: int, params: dict) -> int:
    lines = logs.read_page(task_id, tail=params["tail"], since=params.get("since"))
    return lines[0]["seq"] - 1 if lines else 0


def logs_state(task_id: int):
    return TaskLogState.objects.filter(task_id=task_id).only("first_seq", "dropped_bytes").first()


def event_stream(events) -> StreamingHttpResponse:
    """A follow's answer. The stream reads through its own async pool, so the request's
    Django connection goes back to its pool now: else each open follow would hold one
    until it ends (minutes, hours), and a few dozen followers would take them all."""
    for conn in connections.all(initialized_only=True):
        conn.close()
    response = StreamingHttpResponse(events, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a proxy in front (nginx) must not hold events back
    return response


class TaskEventsView(TaskView):
    """A task's history. People read it (scoped like the task); the agent of the task's
    node adds to it. The history is one answer of at most 500 events, not paged."""

    pagination_class = None
    permission_classes = [PeopleOrAgent]
    agent_methods = ("POST",)
    agent_only_methods = ("POST",)

    @extend_schema(responses=s.TaskEventSerializer(many=True))
    def get(self, request, pk):
        task = self.get_object()
        return Response(s.TaskEventSerializer(task.events.all()[:500], many=True).data)

    @extend_schema(request=s.TaskEventCreateSerializer, responses={201: s.TaskEventSerializer})
    def post(self, request, pk):
        serializer = s.TaskEventCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        task = get_object_or_404(Task, pk=pk, node_id=data["node_id"])
        event = services.record_event(
            task, kind=data["kind"], message=data["message"], details=data["details"], node_id=data["node_id"]
        )
        return Response(s.TaskEventSerializer(event).data, status=status.HTTP_201_CREATED)


class ContainerLostView(APIView):
    """The agent found no container (or process) for a task the server has running on
    its node. It reports the fact; the server decides (docs/failures.md): back to the
    queue while a node that could run it is alive (200, requeue), failed when none is
    (200, fail), and nothing changed when that cannot be told (202, undecided: report
    it again next round). A task that is no longer running on that node is 409."""

    permission_classes = [PeopleOrAgent]
    agent_methods = ("POST",)
    agent_only_methods = ("POST",)

    @extend_schema(
        request=s.ContainerLostSerializer,
        responses={200: s.ContainerLostVerdictSerializer, 202: s.ContainerLostVerdictSerializer},
    )
    def post(self, request, pk):
        serializer = s.ContainerLostSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        node_id = serializer.validated_data["node_id"]
        task = get_object_or_404(Task.objects.filter(Q(node_id=node_id) | Q(node__isnull=True)), pk=pk)
        if task.node_id != node_id or task.status not in LOST_RUN_STATUSES:
            raise Conflict(
                f"Task {task.pk} is {task.status}{'' if task.node_id == node_id else ' elsewhere'}; nothing to decide.",
                CoreErrorCode.STATUS_CHANGED,
            )
        (outcome,) = adjudicate_lost_runs(
            [task.pk], node_id=node_id, cause="container_lost", detail=serializer.validated_data["detail"]
        )
        task.refresh_from_db()
        if outcome.verdict != Verdict.UNDECIDED and not outcome.moved:
            raise Conflict(f"Task {task.pk} is {task.status}; nothing to decide.", CoreErrorCode.STATUS_CHANGED)
        code = status.HTTP_202_ACCEPTED if outcome.verdict == Verdict.UNDECIDED else status.HTTP_200_OK
        return Response({"task_id": task.pk, "verdict": outcome.verdict, "status": task.status}, status=code)


# --- task groups -----------------------------------------------------------------------------


class TaskGroupListView(ScopedAPIView, generics.ListAPIView):
    """The caller's task groups, newest first, paged; `?status=` filters on the status
    derived from the members (in SQL). POST queues a group: all or nothing."""

    queryset = TaskGroup.objects.all()
    serializer_class = s.TaskGroupSerializer

    def get_queryset(self):
        return task_group_list(super().get_queryset(), status=self.params.get("status", ""))

    @extend_schema(parameters=[s.TaskGroupListQuerySerializer])
    def get(self, request, *args, **kwargs):
        serializer = s.TaskGroupListQuerySerializer(data=request.query_params.dict())
        serializer.is_valid(raise_exception=True)
        self.params = serializer.validated_data
        return super().get(request, *args, **kwargs)

    @extend_schema(request=s.TaskGroupCreateSerializer, responses={201: s.TaskGroupDetailSerializer})
    def post(self, request):
        serializer = s.TaskGroupCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        group = submit_group(request.auth, serializer.validated_data)
        return Response(
            s.TaskGroupDetailSerializer(task_group_detail(TaskGroup.objects.all()).get(pk=group.pk)).data,
            status=status.HTTP_201_CREATED,
        )


class TaskGroupView(ScopedAPIView):
    """One group by the id in its URL, among those the caller may see (404 otherwise)."""

    queryset = TaskGroup.objects.all()

    def get_queryset(self):
        return task_group_detail(super().get_queryset())


class TaskGroupDetailView(TaskGroupView):
    """A group with its members in rank order (node, status, host port, cards), its
    network decision and reason, why the scheduler has not placed it, its attempts."""

    @extend_schema(responses=s.TaskGroupDetailSerializer)
    def get(self, request, pk):
        return Response(s.TaskGroupDetailSerializer(self.get_object()).data)


class TaskGroupStopView(TaskGroupView):
    """Stop every member: the queued ones are cancelled, the running ones asked to stop.
    Asking again while it stops is 200; a group that has ended is 409."""

    @extend_schema(request=None, responses=s.TaskGroupDetailSerializer)
    def post(self, request, pk):
        group = self.get_object()
        policy.check_may_stop_task(request.auth, group)
        services.stop_group(group)
        return Response(s.TaskGroupDetailSerializer(self.get_object()).data)


class TaskGroupLogsView(LogView, TaskGroupView):
    """Every member's live log, each line with its rank (`rank=` for one member): a page
    merged in time order, or with `follow=true` an event stream until the group ends.
    The cursor (`next`, the events' ids) is `rank:seq,…`."""

    @extend_schema(parameters=[s.TaskGroupLogsQuerySerializer], responses=log_responses(s.TaskGroupLogsSerializer))
    def get(self, request, pk):
        params = query(s.TaskGroupLogsQuerySerializer, request)
        group = self.get_object()
        cursor = log_stream.parse_group_cursor(request.headers.get("Last-Event-ID") or params["after"])
        members = [
            log_stream.Member(task_id, rank, cursor.get(rank, 0))
            for task_id, rank in group.tasks.order_by("rank").values_list("pk", "rank")
            if params.get("rank") is None or rank == params["rank"]
        ]
        if follows(request, params):
            return event_stream(log_stream.follow(members, group_id=group.pk))
        lines = []
        for member in members:
            page = logs.read_page(
                member.task_id,
                after=member.last,
                tail=params.get("tail"),
                since=params.get("since"),
                limit=params["limit"],
            )
            if page:
                member.last = page[-1]["seq"]
            lines.extend(line | {"rank": member.rank} for line in page)
        lines.sort(key=lambda line: (line["at"], line["rank"], line["seq"]))
        return Response({"group_id": group.pk, "lines": lines, "next": log_stream.group_cursor(members)})


class TaskGroupEventsView(TaskGroupView):
    """The members' task events, each with its rank, newest first, paged."""

    @extend_schema(responses=s.TaskGroupEventSerializer(many=True))
    def get(self, request, pk):
        group = self.get_object()
        page = self.paginate_queryset(task_group_events(group))
        return self.get_paginated_response(s.TaskGroupEventSerializer(page, many=True).data)
