from django.conf import settings as django_settings
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.permissions import IsOperator
from apps.core.principals import PrincipalKind
from apps.core.serializers import StrictSerializer
from apps.core.views import ScopedAPIView
from apps.inference.selectors import open_loans_of_group, open_loans_of_task
from apps.scheduler import cycle, plugins, predictions, queue
from apps.scheduler.core import Decision, GroupDecision, GroupFailure, GroupReq, TaskReq, constraints, model_words
from apps.scheduler.queue import group_constraints
from apps.tasks.api.serializers import RUNTIME_HELP, AffinitySerializer, AntiAffinitySerializer, constraints_problems
from apps.tasks.choices import (
    DEFAULT_PRIORITY,
    MAX_GPUS_PER_TASK,
    MAX_PRIORITY,
    MIN_PRIORITY,
    GroupKind,
    GroupStrategy,
    TaskRuntime,
)
from apps.tasks.models import Task, TaskGroup
from apps.tenants import policy


class PluginRow(serializers.Serializer):
    name = serializers.CharField()
    kind = serializers.CharField()
    enabled = serializers.BooleanField()
    locked = serializers.BooleanField(help_text="Correctness plugins are always on.")
    weight = serializers.FloatField()
    extra = serializers.DictField()


class PluginOptionsSerializer(StrictSerializer):
    weight = serializers.FloatField(min_value=0, max_value=100, required=False)
    extra = serializers.DictField(required=False)


def known(name: str) -> str:
    if name not in plugins.PLUGINS:
        raise NotFound(f"No scheduler plugin '{name}'.")
    return name


class PluginListView(APIView):
    permission_classes = [IsOperator]

    @extend_schema(responses=PluginRow(many=True))
    def get(self, request):
        return Response(plugins.plugin_table())


class PluginView(APIView):
    permission_classes = [IsOperator]

    @extend_schema(
        parameters=[OpenApiParameter("action", str, enum=["enable", "disable"], required=True)],
        request=None,
        responses=PluginRow(many=True),
    )
    def post(self, request, name):
        action = request.query_params.get("action")
        if action not in ("enable", "disable"):
            raise ValidationError({"action": ["Use ?action=enable or ?action=disable."]})
        plugins.set_plugin_enabled(known(name), action == "enable")
        return Response(plugins.plugin_table())

    @extend_schema(request=PluginOptionsSerializer, responses=PluginRow(many=True))
    def put(self, request, name):
        serializer = PluginOptionsSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        plugins.set_plugin_options(known(name), **serializer.validated_data)
        return Response(plugins.plugin_table())


class DryRunSerializer(StrictSerializer):
    tenant = serializers.CharField(required=False, help_text="Tenant slug; operators only, defaults to yours.")
    gpu_required = serializers.IntegerField(min_value=0, max_value=MAX_GPUS_PER_TASK, default=1)
    gpu_memory_mb = serializers.IntegerField(min_value=1, required=False, allow_null=True, default=None)
    gpu_type = serializers.CharField(max_length=20, required=False, allow_blank=True, default="")
    priority = serializers.IntegerField(min_value=MIN_PRIORITY, max_value=MAX_PRIORITY, default=DEFAULT_PRIORITY)
    labels = serializers.DictField(
        child=serializers.CharField(max_length=1024, allow_blank=True), required=False, default=dict
    )
    runtime = serializers.ChoiceField(choices=TaskRuntime.choices, default=TaskRuntime.AUTO, help_text=RUNTIME_HELP)
    affinity = AffinitySerializer(required=False, help_text="as a task's: only nodes with these labels")
    anti_affinity = AntiAffinitySerializer(required=False, help_text="as a task's: never nodes with these labels")

    def validate(self, attrs):
        problems = constraints_problems(attrs, replicas=False)
        if problems:
            raise ValidationError(problems)
        return attrs


def constrained(data: dict) -> dict:
    """A dry run's validated body with its runtime and constraints as the core takes them."""
    found = constraints(data.pop("runtime"), data.pop("affinity", {}), data.pop("anti_affinity", {}))
    return {**data, **found}


class CardMemory(serializers.Serializer):
    node_id = serializers.CharField()
    gpu_index = serializers.IntegerField()
    ledger_free_mb = serializers.IntegerField(help_text="what no holder of the ledger has, before the reserve")
    measured_free_mb = serializers.IntegerField(help_text="the card's total less its latest reading")
    reserve_mb = serializers.IntegerField(help_text="a share's reserve; 0 for a whole card")
    needed_mb = serializers.IntegerField()


class NodeRejection(serializers.Serializer):
    node_id = serializers.CharField()
    filter = serializers.CharField(help_text="the filter that removed it, as counted in removed_by")


class DryRunAnswer(serializers.Serializer):
    placed = serializers.BooleanField()
    node_id = serializers.CharField(allow_null=True)
    gpu_indices = serializers.ListField(child=serializers.IntegerField())
    score = serializers.FloatField(allow_null=True)
    reason = serializers.DictField(
        allow_null=True,
        help_text="as a task's schedule_reason, and: `nodes`, each node removed with the filter that removed it "
        "(NodeRejection, node id order, at most 100); `message`, in words, how its runtime, node labels, "
        "service, its model's pinned nodes or the inference cap kept nodes off; with `memory_in_use` among "
        "its reasons, `cards`: where the cards' readings, "
        "not the ledger, keep the task off (CardMemory each)",
    )


def task_answer(outcome, detail: dict) -> dict:
    if isinstance(outcome, Decision):
        return {
            "placed": True,
            "node_id": outcome.node_id,
            "gpu_indices": outcome.gpu_indices,
            "score": outcome.score,
            "reason": None,
        }
    reason = outcome.as_reason() | detail
    # the model's pinning and the inference cap, in words after the hard constraints'
    words = model_words(reason["removed_by"], django_settings.HETEROFLOW_INFERENCE_CONTAINERS_PER_NODE)
    if words:
        reason["message"] = "; ".join(filter(None, [reason.get("message", ""), *words]))
    return {"placed": False, "node_id": None, "gpu_indices": [], "score": None, "reason": reason}


class DryRunView(APIView):
    """Where a described task would go now, and why; binds nothing."""

    @extend_schema(request=DryRunSerializer, responses=DryRunAnswer)
    def post(self, request):
        serializer = DryRunSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        tenant = policy.acting_tenant(
            request.auth, data.pop("tenant", None), required="Required: the slug of the tenant the task would run for."
        )
        return Response(task_answer(*cycle.explain_now(TaskReq(id=0, tenant_id=tenant.pk, **constrained(data)))))


class LoanRow(serializers.Serializer):
    loan_id = serializers.IntegerField()
    service_id = serializers.IntegerField()
    name = serializers.CharField(help_text="the lending service's name")
    borrower_id = serializers.IntegerField(help_text="the training task (a group's: its rank 0)")
    borrower = serializers.CharField()
    borrower_group_id = serializers.IntegerField(allow_null=True, help_text="a training task group's loan")
    node_id = serializers.CharField(help_text="where the borrower was planned")
    replicas = serializers.IntegerField(help_text="the replicas lent")
    sleeps = serializers.BooleanField(help_text="every replica lent: the service was put to sleep")
    state = serializers.CharField(help_text="open | returned")
    since = serializers.DateTimeField()
    returned_at = serializers.DateTimeField(allow_null=True)
    returned_why = serializers.CharField()


class MoveRow(serializers.Serializer):
    task_id = serializers.IntegerField()
    from_node = serializers.CharField()
    to_node = serializers.CharField()
    cards = serializers.ListField(child=serializers.IntegerField(), help_text="the cards it frees on from_node")


class SuggestionRow(serializers.Serializer):
    change = serializers.DictField(help_text="the submission fields to change; {} for a wait or moves")
    starts = serializers.CharField(
        help_text='"now", when it is expected to start (ISO time), or "after moves" (operators: defragmentation)'
    )
    why = serializers.CharField()
    moves = MoveRow(many=True, required=False, help_text="operators, a waiting gang: the tasks to move")


SUGGESTIONS_HELP = (
    "while it waits: the smallest change of each kind that would place it now (fewer cards, another GPU type, "
    "less memory per card, a hard constraint dropped), tried by the real placement on the same snapshot, then "
    "the wait its estimate foresees (docs/predictions.md#suggestions)"
)


class TaskExplainAnswer(serializers.Serializer):
    task_id = serializers.IntegerField()
    status = serializers.CharField()
    schedule_reason = serializers.DictField(
        help_text="why the last cycle did not place it ({} once bound); code LoanPending: idle inference replicas "
        "stop to lend it their cards (`loan`: node_id, services, replicas)"
    )
    now = DryRunAnswer(allow_null=True, help_text="a dry run of the task now, while it waits; null otherwise")
    suggestions = SuggestionRow(many=True, help_text=SUGGESTIONS_HELP)
    loans = LoanRow(
        many=True,
        help_text="the open loans of idle inference cards it borrows (docs/inference.md#training-borrows-idle-cards)",
    )


class TaskExplainView(ScopedAPIView):
    """Why a task waits: the last cycle's reason, and where it would go now (a dry run
    of the task itself, binding nothing), with the per-card memory numbers when what the
    cards' readings say is in use is what keeps it off."""

    queryset = Task.objects.select_related("group")

    @extend_schema(responses=TaskExplainAnswer)
    def get(self, request, pk):
        task = self.get_object()
        waiting = queue.pending_request(task)
        now, suggestions = None, []
        if waiting is not None:
            outcome, detail = cycle.explain_now(waiting, suggest=True)
            suggestions = predictions.suggestion_rows(detail, task.estimated_start)
            now = task_answer(outcome, detail)
        return Response(
            {
                "task_id": task.pk,
                "status": task.status,
                "schedule_reason": task.schedule_reason,
                "now": now,
                "suggestions": suggestions,
                "loans": open_loans_of_task(task.pk),
            }
        )


# --- task groups ------------------------------------------------------------------------


class GroupDryRunSerializer(StrictSerializer):
    tenant = serializers.CharField(required=False, help_text="Tenant slug; operators only, defaults to yours.")
    kind = serializers.ChoiceField(choices=GroupKind.choices, default=GroupKind.TRAINING)
    strategy = serializers.ChoiceField(choices=GroupStrategy.choices, default=GroupStrategy.DDP)
    world_size = serializers.IntegerField(min_value=1, max_value=1024, help_text="workers")
    gpus_per_worker = serializers.IntegerField(min_value=1, max_value=MAX_GPUS_PER_TASK, default=1)
    gpu_type = serializers.CharField(max_length=20, help_text="every worker on this vendor's cards, strictly")
    priority = serializers.IntegerField(min_value=MIN_PRIORITY, max_value=MAX_PRIORITY, default=DEFAULT_PRIORITY)
    labels = serializers.DictField(
        child=serializers.CharField(max_length=1024, allow_blank=True), required=False, default=dict
    )
    runtime = serializers.ChoiceField(
        choices=TaskRuntime.choices, default=TaskRuntime.AUTO, help_text="every worker's: " + RUNTIME_HELP
    )
    affinity = AffinitySerializer(required=False, help_text="every worker's: only nodes with these labels")
    anti_affinity = AntiAffinitySerializer(required=False, help_text="every worker's: never nodes with these labels")

    validate = DryRunSerializer.validate


class GroupWorker(serializers.Serializer):
    rank = serializers.IntegerField()
    node_id = serializers.CharField()
    gpu_indices = serializers.ListField(child=serializers.IntegerField())


class GroupDryRunAnswer(serializers.Serializer):
    placed = serializers.BooleanField()
    workers = GroupWorker(many=True, help_text="by rank; rank 0's node is the master's")
    score = serializers.IntegerField(allow_null=True, help_text="the batch score: same rack 3, same zone 2, other 0")
    reason = serializers.DictField(allow_null=True, help_text="as a group's schedule_reason")


def group_answer(outcome: GroupDecision | GroupFailure) -> dict:
    if isinstance(outcome, GroupDecision):
        workers = [
            {"rank": rank, "node_id": d.node_id, "gpu_indices": d.gpu_indices}
            for rank, d in enumerate(outcome.decisions)
        ]
        return {"placed": True, "workers": workers, "score": outcome.score, "reason": None}
    return {"placed": False, "workers": [], "score": None, "reason": outcome.as_reason()}


class GroupDryRunView(APIView):
    """Where a described task group would go now, all workers or none, and why not;
    behind the reservations standing for its priority or higher; binds nothing."""

    @extend_schema(request=GroupDryRunSerializer, responses=GroupDryRunAnswer)
    def post(self, request):
        serializer = GroupDryRunSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        tenant = policy.acting_tenant(
            request.auth, data.pop("tenant", None), required="Required: the slug of the tenant the group would run for."
        )
        world_size = data.pop("world_size")
        found = group_constraints(data.pop("runtime"), data.pop("affinity", {}), data.pop("anti_affinity", {}))
        data.update(found)
        group = GroupReq(id=0, tenant_id=tenant.pk, members=tuple(range(1, world_size + 1)), **data)
        return Response(group_answer(cycle.dry_run(group)))


class GroupExplainAnswer(serializers.Serializer):
    group_id = serializers.IntegerField()
    status = serializers.CharField()
    schedule_reason = serializers.DictField(help_text="why the last cycle did not place it ({} once bound)")
    reservation = serializers.DictField(help_text="its report while it is the head of its priority ({} otherwise)")
    network = serializers.DictField(help_text="the network decided at its last bind")
    now = GroupDryRunAnswer(allow_null=True, help_text="a dry run of the group now, while it waits; null otherwise")
    suggestions = SuggestionRow(many=True, help_text=SUGGESTIONS_HELP)
    loans = LoanRow(
        many=True,
        help_text="the open loans of idle inference cards the group borrows (docs/inference.md"
        "#training-borrows-idle-cards)",
    )


def defrag_row(plan) -> dict:
    """A defragmentation plan as an operator's suggestion (docs/predictions.md#defragmentation-advice)."""
    return {
        "change": {},
        "starts": "after moves",
        "why": f"operators: {plan.words()}",
        "moves": [
            {"task_id": m.task_id, "from_node": m.from_node, "to_node": m.to_node, "cards": list(m.cards)}
            for m in plan.moves
        ],
    }


class GroupExplainView(ScopedAPIView):
    """Why a task group waits: the last cycle's reason and reservation, and where it
    would go now (a dry run of the group itself, binding nothing)."""

    queryset = TaskGroup.objects.with_status()

    @extend_schema(responses=GroupExplainAnswer)
    def get(self, request, pk):
        group = self.get_object()
        waiting = queue.waiting_group(group)
        now, suggestions = None, []
        if waiting is not None:
            outcome, detail = cycle.explain_now(waiting, suggest=True)
            suggestions = predictions.suggestion_rows(detail, group.estimated_start)
            now = group_answer(outcome)
            if isinstance(outcome, GroupFailure) and request.auth.kind == PrincipalKind.OPERATOR:
                plan = cycle.defrag_advice(waiting)
                if plan is not None:
                    suggestions.append(defrag_row(plan))
        return Response(
            {
                "group_id": group.pk,
                "status": group.status,
                "schedule_reason": group.schedule_reason,
                "reservation": group.reservation,
                "network": group.network,
                "now": now,
                "suggestions": suggestions,
                "loans": open_loans_of_group(group.pk),
            }
        )
