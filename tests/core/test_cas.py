"""The compare-and-set transition helper, against the task state machine and real
concurrent connections."""

import inspect

import pytest
from django.db.models import F

from apps.core.cas import IllegalTransition, cas_sql, compare_and_set, transition
from apps.scheduler import services as scheduler_services
from apps.tasks.choices import ACTIVE, TERMINAL, TRANSITIONS
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task
from tests.factories import make_node


def test_the_table_covers_every_status_and_terminal_states_are_final():
    assert set(TRANSITIONS) == set(S)
    for status in TERMINAL:
        assert TRANSITIONS[status] == frozenset()
    for status in ACTIVE:
        assert TRANSITIONS[status], status
    assert S.COMPLETED not in TRANSITIONS[S.PREEMPTING]


@pytest.mark.django_db
class TestTransitions:
    @pytest.fixture
    def tenant(self, world):
        return world.tenants["acme"]

    def test_a_legal_transition_wins_once(self, tenant):
        task = Task.objects.create(tenant=tenant, name="t")
        assert transition(Task, TRANSITIONS, task.pk, [S.PENDING], S.SCHEDULED) == [task.pk]
        assert transition(Task, TRANSITIONS, task.pk, [S.PENDING], S.SCHEDULED) == []
        task.refresh_from_db()
        assert task.status == S.SCHEDULED

    def test_an_illegal_transition_is_refused_before_the_database(self, tenant, django_assert_num_queries):
        task = Task.objects.create(tenant=tenant, name="t", status=S.PREEMPTING)
        with django_assert_num_queries(0), pytest.raises(IllegalTransition, match="preempting → completed"):
            transition(Task, TRANSITIONS, task.pk, [S.PREEMPTING], S.COMPLETED)
        with pytest.raises(IllegalTransition):
            transition(Task, TRANSITIONS, task.pk, [S.COMPLETED], S.RUNNING)
        task.refresh_from_db()
        assert task.status == S.PREEMPTING

    def test_a_terminal_report_retried_changes_nothing(self, tenant):
        task = Task.objects.create(tenant=tenant, name="t", status=S.RUNNING)
        assert transition(Task, TRANSITIONS, task.pk, [S.RUNNING], S.COMPLETED) == [task.pk]
        # the agent lost the answer and sends the same report again
        assert transition(Task, TRANSITIONS, task.pk, [S.RUNNING], S.COMPLETED) == []
        assert transition(Task, TRANSITIONS, task.pk, [S.RUNNING], S.FAILED) == []
        task.refresh_from_db()
        assert task.status == S.COMPLETED

    def test_many_rows_at_once_report_the_winners_and_write_extra_fields(self, tenant):
        pending = [Task.objects.create(tenant=tenant, name=f"p{i}") for i in range(3)]
        cancelled = Task.objects.create(tenant=tenant, name="c", status=S.CANCELLED)
        won = transition(
            Task, TRANSITIONS, [t.pk for t in pending] + [cancelled.pk], [S.PENDING], S.SCHEDULED, gpu_required=2
        )
        assert sorted(won) == sorted(t.pk for t in pending)
        assert set(Task.objects.filter(pk__in=won).values_list("gpu_required", flat=True)) == {2}
        assert Task.objects.get(pk=cancelled.pk).gpu_required == 1

    def test_a_reference_is_written_by_its_key_and_the_winners_come_in_key_order(self, tenant):
        node = make_node("cas-n1", gpus=0)
        tasks = [Task.objects.create(tenant=tenant, name=f"r{i}", status=S.SCHEDULED, node=node) for i in range(3)]
        keys = [tasks[2].pk, tasks[0].pk, tasks[1].pk]
        assert transition(Task, TRANSITIONS, keys, [S.SCHEDULED], S.PENDING, node=None) == sorted(keys)
        assert set(Task.objects.filter(pk__in=keys).values_list("node_id", flat=True)) == {None}
        assert transition(Task, TRANSITIONS, tasks[0].pk, [S.PENDING], S.SCHEDULED, node=node) == [tasks[0].pk]
        assert Task.objects.get(pk=tasks[0].pk).node_id == "cas-n1"

    def test_per_row_values_land_on_their_own_rows_and_losers_keep_theirs(self, tenant):
        for name in ("cas-a", "cas-b"):
            make_node(name, gpus=0)
        first, second = (Task.objects.create(tenant=tenant, name=f"b{i}") for i in range(2))
        taken = Task.objects.create(tenant=tenant, name="taken", status=S.CANCELLED)
        won = compare_and_set(
            Task._meta.db_table,
            TRANSITIONS,
            [second.pk, taken.pk, first.pk],
            [S.PENDING],
            S.SCHEDULED,
            per_row={"node_id": ("text", ["cas-b", "cas-a", "cas-a"]), "host_port": ("int", [8001, 8002, None])},
            returning="tasks.host_port",
        )
        assert won == sorted([(first.pk, None), (second.pk, 8001)])
        rows = dict(Task.objects.filter(pk__in=[first.pk, second.pk, taken.pk]).values_list("pk", "node_id"))
        assert rows == {first.pk: "cas-a", second.pk: "cas-b", taken.pk: None}

    def test_an_expression_is_computed_from_the_row_itself(self, tenant):
        tasks = [Task.objects.create(tenant=tenant, name=f"e{i}", status=S.RUNNING, preempt_count=i) for i in range(2)]
        keys = [task.pk for task in tasks]
        assert (
            transition(Task, TRANSITIONS, keys, [S.RUNNING], S.PREEMPTING, preempt_count=F("preempt_count") + 1) == keys
        )
        assert list(Task.objects.filter(pk__in=keys).order_by("pk").values_list("preempt_count", flat=True)) == [1, 2]


def test_one_statement_shape_for_every_move():
    """transition and the scheduler's bind share the statement: no second CAS is written."""
    assert "UPDATE tasks" not in inspect.getsource(scheduler_services.bind_all)
    sql = cas_sql("tasks", fixed=[("updated_at", "%s")], per_row=[("node_id", "text")], returning="tasks.created_at")
    assert sql.startswith(
        "WITH won AS (SELECT id FROM tasks WHERE id = ANY(%s) AND status = ANY(%s) ORDER BY id FOR UPDATE)"
    )
    assert "unnest(%s::bigint[], %s::text[]) AS v(id, node_id)" in sql and sql.endswith(
        "RETURNING tasks.id, tasks.created_at"
    )
