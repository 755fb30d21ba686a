"""The image channel under real concurrency (each racer a thread with its own
connection; kept apart from the module-scoped world fixture, whose open transaction would
hide rows): of several claims exactly one wins; a final report racing the janitor is
applied once, and the loser learns it lost; two operators deploying the same image make
one pull."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.nodes import images
from apps.nodes.models import ImageRequest, Node
from tests.concurrency import together
from tests.factories import make_node

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def node():
    node = make_node("race-img", 1)
    yield node
    Node.objects.filter(pk=node.pk).delete()  # its requests with it


def test_of_six_claims_exactly_one_wins(node):
    row = images.request_pull(node, "hf/x:1")
    claim = images.Report(from_status="pending", status="processing")
    results = together(6, lambda i: images.apply_report(row, claim))
    assert sorted(results) == [False] * 5 + [True]
    assert ImageRequest.objects.get(pk=row.pk).status == "processing"


def test_a_final_report_racing_the_janitor_is_applied_once(node):
    row = images.request_pull(node, "hf/x:1")
    ImageRequest.objects.filter(pk=row.pk).update(status="processing", claimed_at=utcnow() - timedelta(minutes=11))
    done = images.Report(
        from_status="processing",
        status="completed",
        result={
            "images": [
                {
                    "reference": "hf/x:1",
                    "present": True,
                    "match": "exact",
                    "image_id": None,
                    "size_bytes": None,
                    "tags": [],
                }
            ]
        },
    )

    def work(i):
        return images.apply_report(row, done) if i == 0 else images.sweep_image_requests()["stalled"] == 1

    results = together(2, work)
    assert results.count(True) == 1  # the agent's report or the janitor's verdict, never both
    final = ImageRequest.objects.get(pk=row.pk)
    assert final.status in ("completed", "failed") and final.finished_at is not None


def test_two_deploys_of_the_same_image_make_one_pull(node):
    made = together(4, lambda i: images.request_pull(node, "hf/big:1").pk)
    assert len(set(made)) == 1
    assert ImageRequest.objects.filter(node=node).count() == 1
