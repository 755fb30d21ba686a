"""The group-loss verdict as a table: given where the members moved, every member's
status, whether this loss ended the attempt and whether it was the last one allowed,
what follows for the group (apps.tasks.services.group_loss_verdict; docs/failures.md).
Pure: no database."""

import pytest

from apps.tasks.services import GROUP_LOSS_APPLIERS, GroupLoss, GroupLossFacts, group_loss_verdict

V = GroupLoss

CASES = [
    # to_status, the members' statuses, ended_now, last_attempt -> verdict
    ("stopped", {"stopped", "running"}, True, False, V.STOP),
    ("stopped", {"stopped", "failed"}, False, True, V.STOP),
    ("pending", {"pending", "failed"}, False, False, V.JOIN_FAILURE),
    ("pending", {"pending", "failed", "completed"}, True, True, V.JOIN_FAILURE),
    ("pending", {"pending", "stopping"}, True, False, V.CANCEL),
    ("pending", {"pending", "cancelled", "completed"}, False, False, V.CANCEL),
    ("failed", {"failed", "stopping"}, False, False, V.FAIL),
    ("failed", {"failed", "running"}, True, False, V.FAIL),
    ("failed", {"failed", "running"}, False, True, V.FAIL_LAST_ATTEMPT),
    ("failed", {"failed", "completed"}, True, True, V.FAIL_AFTER_COMPLETION),
    ("pending", {"pending", "completed"}, False, False, V.FAIL_AFTER_COMPLETION),
    ("pending", {"pending", "running"}, True, True, V.FAIL_LAST_ATTEMPT),
    ("pending", {"pending", "preempting"}, False, True, V.NOTHING),
    ("pending", {"pending", "preempting"}, False, False, V.NOTHING),
    ("pending", {"pending", "running", "scheduled"}, True, False, V.REQUEUE),
]


@pytest.mark.parametrize(("to_status", "statuses", "ended_now", "last_attempt", "verdict"), CASES)
def test_group_loss_verdict(to_status, statuses, ended_now, last_attempt, verdict):
    facts = GroupLossFacts(to_status, frozenset(statuses), ended_now, last_attempt)
    assert group_loss_verdict(facts) == verdict


def test_every_verdict_has_one_applier_and_the_table_reaches_each():
    assert set(GROUP_LOSS_APPLIERS) == set(GroupLoss)
    assert {case[-1] for case in CASES} == set(GroupLoss)
