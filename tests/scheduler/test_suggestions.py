"""What would start a waiting task or group now (apps.scheduler.core.suggestions, and
GET /api/v1/tasks/{id}/explain's and the group's `suggestions`): each kind's smallest
change, found by the real placement on the snapshot; every suggestion places the work on
the snapshot it was computed on; a wait names the running task whose end frees the cards."""

from dataclasses import replace
from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.scheduler.core import PluginSettings, place_queue
from apps.scheduler.core.forecast import copy_nodes
from apps.scheduler.core.suggestions import MEMORY_STEP_MB, Suggestion, largest, suggest
from apps.scheduler.models import GpuAllocation
from apps.scheduler.predictions import predict
from apps.tasks.models import Task
from tests.factories import make_group, make_node, make_task
from tests.headers import bearer
from tests.portal.client import signed_in
from tests.scheduler.snapshots import SAME_TENANT_ONLY, gpus, group, node, task

ANYWHERE = PluginSettings()


def placer(nodes):
    """The real placement bound to a snapshot: each try on its own copy."""

    def places(work) -> bool:
        placement = place_queue([work], copy_nodes(nodes), ANYWHERE, SAME_TENANT_ONLY)
        return bool(placement.decisions or placement.groups)

    return places


def busy(one, cards):
    for index in cards:
        one.gpus[index].holders.append((999, 1, None))
    return one


def applied(work, change: dict):
    """The request with a suggestion's change, as the submission would make it."""
    fields = {
        "gpu_required": "gpu_required",
        "gpus_per_worker": "gpus_per_worker",
        "gpu_type": "gpu_type",
        "gpu_memory_mb": "gpu_memory_mb",
        "labels": "labels",
        "runtime": "runtime",
    }
    for key, value in change.items():
        if key == "affinity":
            work = replace(work, affinity_labels=(value or {}).get("nodes_with_labels", {}))
        elif key == "anti_affinity":
            work = replace(work, anti_affinity_labels=(value or {}).get("labels", {}))
        else:
            work = replace(work, **{fields[key]: value})
    return work


def test_largest_finds_the_edge_of_a_monotone_fit():
    assert largest(1, 7, lambda n: n <= 5) == 5
    assert largest(1, 7, lambda n: True) == 7
    assert largest(1, 7, lambda n: False) is None
    assert largest(3, 2, lambda n: True) is None


def test_fewer_cards_is_the_most_that_fit_and_another_type_is_offered():
    nodes = [busy(node("n0"), range(3)), node("a0", gpus=gpus(8, vendor="ascend"))]  # 5 nvidia cards free
    waiting = task(gpus=8, gpu_type="nvidia")
    found = suggest(waiting, nodes, placer(nodes))
    assert found == [
        Suggestion({"gpu_required": 5}, "5 cards instead of 8 fit on one node now"),
        Suggestion({"gpu_type": "ascend"}, "ascend cards are free for it now"),
    ]
    for suggestion in found:  # each places on the snapshot it was computed on
        assert placer(nodes)(applied(waiting, suggestion.change))


def test_a_group_halves_its_cards_per_worker():
    nodes = [busy(node(f"n{n}"), range(5)) for n in range(2)]  # 3 free on each
    waiting = group(workers=2, gpus=8)
    found = suggest(waiting, nodes, placer(nodes))
    assert found == [Suggestion({"gpus_per_worker": 2}, "2 cards per worker instead of 8 fit now")]
    assert placer(nodes)(applied(waiting, found[0].change))


def test_less_memory_is_the_most_that_fits_in_steps():
    nodes = [node("n0", gpus=gpus(1, memory=10_000))]
    nodes[0].gpus[0].holders.append((999, 1, 7_000))  # a share holds 7,000 MB of the 10,000
    waiting = task(gpus=0, gpu_memory_mb=6_000)
    found = suggest(waiting, nodes, placer(nodes))
    assert len(found) == 1 and set(found[0].change) == {"gpu_memory_mb"}
    memory = found[0].change["gpu_memory_mb"]
    assert memory % MEMORY_STEP_MB == 0 and memory < 6_000
    assert placer(nodes)(applied(waiting, found[0].change))
    assert not placer(nodes)(replace(waiting, gpu_memory_mb=memory + MEMORY_STEP_MB))


def test_a_hard_constraint_is_dropped_one_at_a_time():
    nodes = [
        node("n0", labels={"disk": "ssd"}, exec_mode="process"),
        node("n1", labels={"disk": "hdd", "zone-b": "1"}, exec_mode="process"),
    ]
    # two constraints keep every node off: dropping either one alone still leaves the other
    both = task(gpus=1, affinity_labels={"disk": "nvme"}, runtime="container")
    assert suggest(both, nodes, placer(nodes)) == []
    only_affinity = task(gpus=1, affinity_labels={"disk": "nvme", "zone-b": "1"})
    assert suggest(only_affinity, nodes, placer(nodes)) == [
        Suggestion(
            {"affinity": {"nodes_with_labels": {"zone-b": "1"}}}, "without the affinity label `disk` it fits now"
        )
    ]
    # each node carries one of the two avoided labels: dropping either frees a node
    only_anti = task(gpus=1, anti_affinity_labels={"disk": "ssd", "zone-b": "1"})
    assert suggest(only_anti, nodes, placer(nodes)) == [
        Suggestion(
            {"anti_affinity": {"labels": {"zone-b": "1"}}}, "without the anti-affinity label `disk` it fits now"
        ),
        Suggestion(
            {"anti_affinity": {"labels": {"disk": "ssd"}}}, "without the anti-affinity label `zone-b` it fits now"
        ),
    ]
    only_runtime = task(gpus=1, runtime="container")
    assert suggest(only_runtime, nodes, placer(nodes)) == [
        Suggestion({"runtime": "auto"}, "with any runtime, not only container, it fits now")
    ]
    for work in (only_affinity, only_anti, only_runtime):
        for found in suggest(work, nodes, placer(nodes)):
            assert placer(nodes)(applied(work, found.change))


def test_nothing_is_suggested_for_work_no_change_of_one_kind_would_place():
    nodes = [busy(node("n0"), range(8))]
    assert suggest(task(gpus=4), nodes, placer(nodes)) == []


@pytest.mark.django_db
def test_explain_lists_the_suggestions_and_the_wait_naming_the_task_that_frees_the_cards(api, world):
    acme = world.tenants["acme"]
    node_ = make_node("n1", gpus=8)
    make_node("a1", gpus=2, vendor="ascend")
    blocker = make_task(
        acme,
        name="blocker",
        status="running",
        node=node_,
        gpu_required=4,
        started_at=utcnow() - timedelta(seconds=100),
        max_duration_seconds=3700,
    )
    for card in range(4):
        GpuAllocation.objects.create(task=blocker, node=node_, gpu_index=card, tenant=acme)
    waiting = make_task(acme, name="big", gpu_required=8, gpu_type="nvidia")
    predict()
    key = bearer(world.keys["acme-viewer"])
    answer = api.get(f"/api/v1/tasks/{waiting.pk}/explain", **key).json()
    assert answer["now"]["placed"] is False
    rows = answer["suggestions"]
    fewer = {"change": {"gpu_required": 4}, "starts": "now", "why": "4 cards instead of 8 fit on one node now"}
    assert rows[0] == fewer
    assert rows[-1]["change"] == {} and rows[-1]["starts"] == answer_estimate(api, key, waiting)
    assert rows[-1]["why"].startswith(f"wait for task {blocker.pk} (blocker) to end at about ")
    assert len(rows) == 2  # the 2 ascend cards take no 8-card task

    gang = make_group(acme, workers=2, gpus=8)
    group_answer = api.get(f"/api/v1/task-groups/{gang.pk}/explain", **key).json()
    assert group_answer["suggestions"][0] == {
        "change": {"gpus_per_worker": 2},
        "starts": "now",
        "why": "2 cards per worker instead of 8 fit now",
    }

    # a task that is not waiting has none
    running = api.get(f"/api/v1/tasks/{blocker.pk}/explain", **key).json()
    assert running["now"] is None and running["suggestions"] == []


def answer_estimate(api, key, task) -> str:
    return api.get(f"/api/v1/tasks/{task.pk}", **key).json()["estimated_start"]["p50"]


# --- taking a suggestion: POST /api/v1/tasks/{id}/resubmit and the portal's button -------------


def resubmit(api, key, task, change):
    return api.post(f"/api/v1/tasks/{task.pk}/resubmit", {"change": change}, format="json", **bearer(key))


@pytest.mark.django_db
def test_resubmitting_queues_the_change_cancels_the_task_and_records_both(api, world):
    acme = world.tenants["acme"]
    old = make_task(
        acme,
        name="big",
        gpu_required=8,
        command=["python", "train.py"],
        env={"A": "1"},
        labels={"rack": "r1"},
        affinity={"nodes_with_labels": {"disk": "nvme"}},
        priority=70,
        timeout_seconds=7200,
    )
    answer = resubmit(api, world.keys["acme-member"], old, {"gpu_required": 4, "affinity": None})
    assert answer.status_code == 201, answer.json()
    new = Task.objects.get(pk=answer.json()["id"])
    old.refresh_from_db()
    assert old.status == "cancelled" and new.status == "pending"
    # the submission is the old one's, with the change
    assert (new.name, new.command, new.env, new.labels, new.priority, new.timeout_seconds) == (
        "big",
        ["python", "train.py"],
        {"A": "1"},
        {"rack": "r1"},
        70,
        7200,
    )
    assert new.gpu_required == 4 and new.affinity == {}
    assert old.events.get(kind="resubmitted").details == {"as": new.pk, "change": {"gpu_required": 4, "affinity": None}}
    assert new.events.get(kind="resubmitted_from").details["from"] == old.pk


@pytest.mark.django_db
def test_a_refused_resubmission_writes_nothing(api, world):
    acme = world.tenants["acme"]
    old = make_task(acme, name="big", gpu_required=8)
    member = world.keys["acme-member"]
    before = Task.objects.count()
    cases = [
        (member, {"image": "evil"}, 400),  # not a field a suggestion changes
        (member, {}, 400),
        (member, {"gpu_required": -1}, 400),  # validated as a create
        (world.keys["acme-viewer"], {"gpu_required": 4}, 403),
        (world.keys["beta-member"], {"gpu_required": 4}, 404),
    ]
    for key, change, status in cases:
        answer = resubmit(api, key, old, change)
        assert answer.status_code == status, (change, answer.json())
    running = make_task(acme, name="r", status="running")
    assert resubmit(api, member, running, {"gpu_required": 1}).status_code == 409
    member_of_group = Task.objects.filter(group=make_group(acme, workers=1)).get()
    assert resubmit(api, member, member_of_group, {"gpu_required": 1}).status_code == 409
    assert Task.objects.count() == before + 2  # the two made here, nothing else
    old.refresh_from_db()
    assert old.status == "pending" and not old.events.exists()


@pytest.mark.django_db
def test_the_task_page_offers_each_suggestion_and_its_button_resubmits(client, world):
    acme = world.tenants["acme"]
    make_node("n1", gpus=2)
    old = make_task(acme, name="big", gpu_required=8)
    member = signed_in(client, world.users["acme-member"])
    html = member.get(f"/portal/tasks/{old.pk}/").content.decode()
    assert 'data-suggestion="{&quot;gpu_required&quot;:2}"' in html
    assert "2 cards instead of 8 fit on one node now" in html and "Resubmit with this change" in html
    viewer_html = signed_in(client, world.users["acme-viewer"]).get(f"/portal/tasks/{old.pk}/").content.decode()
    assert "2 cards instead of 8" in viewer_html and "Resubmit with this change" not in viewer_html

    member = signed_in(client, world.users["acme-member"])
    answer = member.post(f"/portal/tasks/{old.pk}/resubmit/", {"change": '{"gpu_required": 2}'})
    new = Task.objects.exclude(pk=old.pk).get(name="big")
    assert answer.status_code == 302 and answer["Location"] == f"/portal/tasks/{new.pk}/"
    assert new.gpu_required == 2 and Task.objects.get(pk=old.pk).status == "cancelled"
    again = member.post(f"/portal/tasks/{old.pk}/resubmit/", {"change": '{"gpu_required": 1}'}, follow=True)
    assert "Not resubmitted: Task" in again.content.decode() and Task.objects.filter(name="big").count() == 2
