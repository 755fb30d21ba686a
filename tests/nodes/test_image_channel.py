"""The agent's side of the image channel (docs/images.md): its poll, the claim, progress
and final reports as compare-and-sets, "pulled but not there", an old agent's :latest
answer, a check's repository match; and the contract: every body the agent sends here
and every answer it gets fit image_channel.schema.json."""

from __future__ import annotations

import pytest

from apps.nodes import images
from apps.nodes.choices import IMAGE_REQUEST_TRANSITIONS
from apps.nodes.models import ImageRequest
from tests.factories import make_node
from tests.headers import AGENT, bearer
from tests.nodes.image_support import (
    DIGEST,
    SCHEMA,
    assert_fits,
    claim,
    completed,
    failed,
    item,
    progress,
    report,
    validator,
)

pytestmark = pytest.mark.django_db

REF = "127.0.0.1:5000/hf/tiny:1.0"


@pytest.fixture
def node():
    return make_node("agent-img", 1)


def new_pull(node, reference=REF) -> ImageRequest:
    return images.request_pull(node, reference, requested_by="op")


def new_check(node, references) -> ImageRequest:
    return images.request_check(node, references, requested_by="op")


def poll(api, node_id, status="pending"):
    answer = api.get(f"/api/v1/agent/image-requests?node_id={node_id}&status={status}", **AGENT)
    assert answer.status_code == 200, answer.content
    assert_fits("agent_list", answer.json())
    return answer.json()["results"]


def test_the_agent_polls_its_nodes_pending_requests_oldest_first_at_most_five(api, node):
    other = make_node("elsewhere", 1)
    made = [new_pull(node, f"hf/tiny:{i}").pk for i in range(7)]
    new_pull(other)
    assert [r["id"] for r in poll(api, node.pk)] == made[:5]
    assert poll(api, "elsewhere")[0]["node_id"] == "elsewhere"
    assert poll(api, node.pk, "processing") == []
    assert api.get(f"/api/v1/agent/image-requests?node_id={node.pk}", **AGENT).status_code == 400
    assert api.get("/api/v1/agent/image-requests?status=pending", **AGENT).status_code == 400


def test_the_agent_channel_is_the_agents_only(api, world, node):
    row = new_pull(node)
    operator = bearer(world.operator_key)
    assert api.get(f"/api/v1/agent/image-requests?node_id={node.pk}&status=pending", **operator).status_code == 403
    assert (
        api.put(f"/api/v1/agent/image-requests/{row.pk}", claim(node.pk), format="json", **operator).status_code == 403
    )
    assert ImageRequest.objects.get(pk=row.pk).status == "pending"


def test_a_pull_claimed_reported_and_completed(api, node):
    row = new_pull(node)
    claimed = report(api, row.pk, claim(node.pk))
    assert claimed.status_code == 200, claimed.content
    assert_fits("request", claimed.json())
    assert claimed.json()["status"] == "processing" and claimed.json()["claimed_at"]
    second = report(api, row.pk, claim(node.pk))
    assert second.status_code == 409 and second.json()["error"]["code"] == "status_changed"
    moving = report(api, row.pk, progress(node.pk, 2, 4))
    assert moving.status_code == 200
    assert moving.json()["progress"]["layers_done"] == 2 and moving.json()["progress_at"]
    assert_fits("request", moving.json())
    done = report(api, row.pk, completed(node.pk, item(REF)))
    assert done.status_code == 200, done.content
    assert_fits("request", done.json())
    assert done.json()["status"] == "completed" and done.json()["finished_at"]
    assert done.json()["result"]["images"][0]["image_id"] == DIGEST
    # a retried final report changes nothing twice
    assert report(api, row.pk, completed(node.pk, item(REF))).status_code == 409
    assert report(api, row.pk, progress(node.pk)).status_code == 409


def test_a_pull_completed_without_its_image_is_stored_failed(api, node):
    row = new_pull(node)
    report(api, row.pk, claim(node.pk))
    absent = report(api, row.pk, completed(node.pk, item(REF, present=False)))
    assert absent.status_code == 200
    assert absent.json()["status"] == "failed"
    assert absent.json()["error"].startswith("pulled but not there")
    other = new_pull(node, "hf/other:1")
    report(api, other.pk, claim(node.pk))
    unrelated = report(api, other.pk, completed(node.pk, item("hf/somethingelse:1")))
    assert unrelated.json()["status"] == "failed" and "pulled but not there" in unrelated.json()["error"]
    empty = new_pull(node, "hf/empty:1")
    report(api, empty.pk, claim(node.pk))
    assert report(api, empty.pk, completed(node.pk)).json()["status"] == "failed"


def test_an_old_agents_latest_answer_to_a_bare_reference_is_accepted(api, node):
    row = new_pull(node, "127.0.0.1:5000/hf/tiny")
    report(api, row.pk, claim(node.pk))
    done = report(api, row.pk, completed(node.pk, item("127.0.0.1:5000/hf/tiny:latest")))
    assert done.json()["status"] == "completed", done.json()
    assert done.json()["result"]["images"][0]["reference"] == "127.0.0.1:5000/hf/tiny"  # stored as asked
    # but ":latest" answers only a bare reference
    tagged = new_pull(node, "127.0.0.1:5000/hf/tiny:2.0")
    report(api, tagged.pk, claim(node.pk))
    wrong = report(api, tagged.pk, completed(node.pk, item("127.0.0.1:5000/hf/tiny:latest")))
    assert wrong.json()["status"] == "failed"


def test_a_check_answers_exact_and_repository_matches(api, node):
    row = new_check(node, [REF, "127.0.0.1:5000/hf/tiny", "hf/missing:1"])
    report(api, row.pk, claim(node.pk))
    repository = item(
        "127.0.0.1:5000/hf/tiny",
        match="repository",
        tags=[
            {"tag": "127.0.0.1:5000/hf/tiny:1.0", "image_id": DIGEST, "size_bytes": 5_000},
            {"tag": "127.0.0.1:5000/hf/tiny:2.0", "image_id": "sha256:" + "cd" * 32, "size_bytes": 6_000},
        ],
    )
    done = report(api, row.pk, completed(node.pk, item(REF), repository, item("hf/missing:1", present=False)))
    assert done.json()["status"] == "completed", done.json()
    assert_fits("request", done.json())
    found = {i["reference"]: i for i in done.json()["result"]["images"]}
    assert found[REF]["present"] and not found["hf/missing:1"]["present"]
    assert [t["tag"] for t in found["127.0.0.1:5000/hf/tiny"]["tags"]][1].endswith(":2.0")


def test_a_check_that_leaves_a_reference_unanswered_fails(api, node):
    row = new_check(node, ["hf/a:1", "hf/b:1"])
    report(api, row.pk, claim(node.pk))
    answer = report(api, row.pk, completed(node.pk, item("hf/a:1")))
    assert answer.json()["status"] == "failed" and "hf/b:1" in answer.json()["error"]


def test_a_failed_pull_keeps_the_agents_words(api, node):
    row = new_pull(node)
    report(api, row.pk, claim(node.pk))
    answer = report(api, row.pk, failed(node.pk, "manifest for hf/tiny:1.0 not found: manifest unknown"))
    assert answer.status_code == 200
    assert answer.json()["status"] == "failed" and "manifest unknown" in answer.json()["error"]


def test_another_nodes_request_is_404(api, node):
    row = new_pull(node)
    make_node("thief", 1)
    assert report(api, row.pk, claim("thief")).status_code == 404
    assert report(api, 987_654, claim(node.pk)).status_code == 404
    assert ImageRequest.objects.get(pk=row.pk).status == "pending"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"from_status": "pending", "status": "completed", "result": {"images": []}}, "status"),
        ({"from_status": "processing", "status": "pending"}, "status"),
        ({"from_status": "pending", "status": "failed", "error": "no"}, "status"),
        ({"from_status": "processing", "status": "processing"}, "progress"),
        (
            {"from_status": "processing", "status": "processing", "progress": {"layers_done": -1}},
            "progress.layers_done",
        ),
        ({"from_status": "processing", "status": "processing", "progress": {"speed": 3}}, "progress"),
        ({"from_status": "processing", "status": "completed"}, "result"),
        (
            {"from_status": "processing", "status": "completed", "result": {"images": [{"reference": "x"}]}},
            "result.images[0]",
        ),
        ({"from_status": "processing", "status": "failed", "error": " "}, "error"),
        ({"from_status": "done", "status": "processing"}, "from_status"),
    ],
)
def test_a_bad_report_is_400_and_changes_nothing(api, node, body, field):
    row = new_pull(node)
    report(api, row.pk, claim(node.pk))
    before = ImageRequest.objects.values().get(pk=row.pk)
    answer = api.put(f"/api/v1/agent/image-requests/{row.pk}", {"node_id": node.pk, **body}, format="json", **AGENT)
    assert answer.status_code == 400, answer.content
    assert field in answer.json()["error"]["fields"], answer.json()
    assert ImageRequest.objects.values().get(pk=row.pk) == before


def test_a_newer_agents_unknown_top_level_field_is_ignored(api, node):
    row = new_pull(node)
    answer = api.put(
        f"/api/v1/agent/image-requests/{row.pk}", {**claim(node.pk), "worker": "w2"}, format="json", **AGENT
    )
    assert answer.status_code == 200 and answer.json()["status"] == "processing"


def test_the_contract_covers_the_transitions_the_server_allows():
    """The schema's reports are exactly the moves IMAGE_REQUEST_TRANSITIONS allows."""
    claim_def = SCHEMA["definitions"]["claim_report"]["properties"]
    final_def = SCHEMA["definitions"]["final_report"]["properties"]
    moves = {(claim_def["from_status"]["const"], claim_def["status"]["const"])}
    moves |= {(final_def["from_status"]["const"], status) for status in final_def["status"]["enum"]}
    allowed = {(source, target) for source, targets in IMAGE_REQUEST_TRANSITIONS.items() for target in targets}
    assert moves == allowed - {("pending", "failed")}  # pending → failed is the janitor's, never the agent's
    assert SCHEMA["definitions"]["status"]["enum"] == ["pending", "processing", "completed", "failed"]
    for body in (claim("n"), progress("n"), completed("n", item("a/b:1")), failed("n")):
        assert (
            validator("final_report").is_valid(body)
            or validator("claim_report").is_valid(body)
            or (validator("progress_report").is_valid(body))
        )
    assert not validator("final_report").is_valid({"node_id": "n", "from_status": "processing", "status": "completed"})


def test_a_bare_pull_answered_by_a_repository_match_must_show_latest(api, node):
    row = new_pull(node, "hf/tiny")
    report(api, row.pk, claim(node.pk))
    other_tags = item("hf/tiny", match="repository", tags=[{"tag": "hf/tiny:1.0", "image_id": DIGEST, "size_bytes": 1}])
    assert report(api, row.pk, completed(node.pk, other_tags)).json()["status"] == "failed"
    row = new_pull(node, "hf/tiny")
    report(api, row.pk, claim(node.pk))
    latest = item("hf/tiny", match="repository", tags=[{"tag": "hf/tiny:latest", "image_id": DIGEST, "size_bytes": 1}])
    assert report(api, row.pk, completed(node.pk, latest)).json()["status"] == "completed"


def test_the_watched_list_of_a_page_is_the_same_rule_in_one_query(node, django_assert_num_queries):
    ascend = make_node("npu-2", 1, vendor="ascend")
    bare = make_node("cpu-2", 0)
    with django_assert_num_queries(1):
        grouped = images.watched_by_vendor()
    for each in (node, ascend, bare):
        assert [w.pk for w in images.watched_for(each, grouped)] == [w.pk for w in images.watched_images(each)]


def test_an_overlong_error_is_kept_to_its_limit_not_refused(api, node):
    row = new_pull(node)
    report(api, row.pk, claim(node.pk))
    body = {**failed(node.pk), "error": "x" * 10_000}
    answer = api.put(f"/api/v1/agent/image-requests/{row.pk}", body, format="json", **AGENT)
    assert answer.status_code == 200 and answer.json()["status"] == "failed"
    assert len(answer.json()["error"]) == images.ERROR_MAX
