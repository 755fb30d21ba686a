"""`hf explain` says in words why nodes were filtered out: its table (the client never
imports the server) must know every reason the scheduler's filters give."""

from heteroflow_client.cli import REMOVED, reason_words

from apps.scheduler.core.filters import REASON_ORDER


def test_hf_has_words_for_every_reason_a_filter_gives():
    assert sorted(set(REASON_ORDER) - set(REMOVED)) == []


def test_a_constraint_reason_reads_as_words():
    words = reason_words({"code": "NoSchedulableNodes", "removed_by": {"affinity": 3, "same_service": 1}})
    assert "3 nodes without the labels it asks for" in words
    assert "1 node already holding a replica of its service" in words
