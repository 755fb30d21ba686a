"""The wake patrol's rule for one open loan (apps.inference.lending.give_back_verdict),
pure: every row of its table, in its order, and the loans that stand."""

from datetime import UTC, datetime, timedelta

import pytest

from apps.inference.lending import BIND_TIMEOUT, give_back_verdict

LENT = datetime(2026, 12, 7, 6, 0, tzinfo=UTC)
NOW = LENT + timedelta(seconds=30)


def verdict(**changes):
    facts = {
        "sleeps": False,
        "to_replicas": 1,
        "service_state": "running",
        "service_replicas": 1,
        "need": 0,
        "in_flight": 0,
        "borrower": "training task 9",
        "borrower_status": "running",
        "borrower_node": "n1",
        "lent_on": "n1",
        "bound_at": LENT + timedelta(seconds=10),
        "lent_at": LENT,
        "now": NOW,
    }
    return give_back_verdict(**(facts | changes))


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"borrower_status": "pending", "bound_at": None},  # waiting for the cards, within the time-out
        {"sleeps": True, "service_state": "sleeping", "to_replicas": 0},
        {"need": 1, "in_flight": 8},  # one replica carries the reading
        {"need": None, "in_flight": None},  # no reading is no traffic
    ],
)
def test_a_loan_stands(changes):
    assert verdict(**changes) is None


@pytest.mark.parametrize(
    "changes,why,preempt,restore",
    [
        ({"service_state": "stopping"}, "the service is stopping: the loan ends", False, False),
        ({"service_state": "paused"}, "the service is paused: the loan ends", False, False),
        ({"borrower_status": "completed"}, "training task 9 is completed", False, True),
        ({"borrower_status": "stopped"}, "training task 9 is stopped", False, True),
        ({"borrower_status": "pending"}, "training task 9 gave the cards up (back in the queue)", False, True),
        (
            {"borrower_status": "pending", "bound_at": None, "now": LENT + BIND_TIMEOUT},
            "training task 9 was not placed on the lent cards within 120 s",
            False,
            True,
        ),
        (
            {"borrower_node": "n2"},
            "training task 9 was placed on n2, not on the lent cards of n1",
            False,
            True,
        ),
        (
            {"sleeps": True, "service_state": "waking", "to_replicas": 0},
            "traffic: the service was woken (waking)",
            True,
            True,
        ),
        (
            {"sleeps": True, "service_state": "sleeping", "to_replicas": 0, "in_flight": 3},
            "traffic: 3 requests in flight while asleep",
            True,
            True,
        ),
        ({"service_replicas": 2}, "traffic: its count went up to 2 (lent down to 1)", True, True),
        ({"need": 3}, "traffic: the gateway's reading needs 3 replicas (lent down to 1)", True, True),
        (
            {"need": 3, "borrower_status": "scheduled", "bound_at": None},
            "traffic: the gateway's reading needs 3 replicas (lent down to 1)",
            True,
            True,
        ),
    ],
)
def test_a_loan_is_given_back(changes, why, preempt, restore):
    found = verdict(**changes)
    assert (found.why, found.preempt, found.restore) == (why, preempt, restore)


def test_traffic_while_the_borrower_waits_gives_back_without_a_preemption():
    found = verdict(borrower_status="pending", bound_at=None, service_replicas=2)
    assert found.why.startswith("traffic") and not found.preempt
