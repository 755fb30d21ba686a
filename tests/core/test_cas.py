"""The compare-and-set transition helper, against the task state machine and real
concurrent connections."""

import pytest

from apps.core.cas import IllegalTransition, transition
from apps.tasks.choices import ACTIVE, TERMINAL, TRANSITIONS
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task


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
