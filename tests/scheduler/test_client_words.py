"""`hf explain` says in words why nodes were filtered out: its table (the client never
imports the server) must know every reason the scheduler's filters give."""

from heteroflow_client.cli import REMOVED, explain_words, reason_words

from apps.scheduler.core.filters import REASON_ORDER


def test_hf_has_words_for_every_reason_a_filter_gives():
    assert sorted(set(REASON_ORDER) - set(REMOVED)) == []


def test_a_constraint_reason_reads_as_words():
    words = reason_words({"code": "NoSchedulableNodes", "removed_by": {"affinity": 3, "same_service": 1}})
    assert "3 nodes without the labels it asks for" in words
    assert "1 node already holding a replica of its service" in words


def test_a_loan_reads_as_words_while_it_waits_and_once_it_holds_the_cards():
    loan = {
        "node_id": "n1",
        "services": [{"service_id": 7, "name": "chat", "replicas": 2, "sleeps": True}],
        "replicas": [11, 12],
    }
    words = reason_words({"code": "LoanPending", "cause": "InsufficientResources", "loan": loan})
    assert words.startswith("idle inference replicas of its tenant are stopping to lend it their cards")
    assert "borrowing on n1 from chat (service 7): 2 replicas, put to sleep" in words
    running = {"task_id": 5, "status": "running", "loans": [{**loan["services"][0], "since": "2026-12-07T06:00"}]}
    assert explain_words(running) == [
        "Task 5 is running: it is not waiting to be placed.",
        "It holds cards lent by chat (service 7): 2 replicas, put to sleep since 2026-12-07T06:00; "
        "traffic to that service takes them back (the task is preempted).",
    ]


def test_the_suggestions_read_as_changes_hf_run_takes_and_a_wait():
    answer = {
        "task_id": 9,
        "status": "pending",
        "schedule_reason": {},
        "now": None,
        "suggestions": [
            {"change": {"gpu_required": 4}, "starts": "now", "why": "4 cards instead of 8 fit on one node now"},
            {"change": {"affinity": None}, "starts": "now", "why": "without the affinity label `disk` it fits now"},
            {"change": {}, "starts": "2026-12-07T18:00:00+00:00", "why": "wait for task 3 (train) to end at about …"},
            {"change": {}, "starts": "after moves", "why": "operators: move task 4 from n0 to n2: frees 4 on n0 cards"},
        ],
    }
    assert explain_words(answer)[-5:] == [
        "What would start it:",
        "  gpu_required=4 (starts now): 4 cards instead of 8 fit on one node now",
        "  affinity=null (starts now): without the affinity label `disk` it fits now",
        "  no change (starts at about 2026-12-07T18:00:00+00:00): wait for task 3 (train) to end at about …",
        "  no change (starts after the moves): operators: move task 4 from n0 to n2: frees 4 on n0 cards",
    ]
