"""Training borrows idle inference cards, through the real cycle and the wake patrol
(apps.scheduler.lending, apps.inference.lending): a lending round (the idle service
scaled down or put to sleep, a `borrowed` decision naming the task, the training bound
on the freed cards once the replicas stopped), a reclaim round (traffic: the service
rescaled or woken, the training preempted through the graceful stop and requeued), the
training's end giving the cards back, the opt-out, the cap and the cross-tenant red line."""

from datetime import timedelta

import pytest
from django.test import override_settings
from heteroflow_client.cli import explain_words

from apps.inference import lending
from apps.inference.jobs import lending_patrol_job, wake_service_job
from apps.inference.models import InferenceService, ServiceDecision, ServiceLoan
from apps.scheduler.cycle import run_cycle
from apps.scheduler.models import GpuAllocation
from apps.tasks.models import Task
from apps.tasks.services import stop_task
from apps.tenants.services import save_group
from tests.factories import make_group, make_node, make_task
from tests.headers import bearer
from tests.inference.lending_support import confirm, in_flight, service, serving, wipe_signals
from tests.inference.services_helpers import body, make_model
from tests.scheduler.ledger import ledger_agrees

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def clean_signals():
    wipe_signals()
    yield
    wipe_signals()


@pytest.fixture
def n1():
    return make_node("n1", gpus=2)


def training(world, slug="acme", gpus=1, **fields):
    return make_task(world.tenants[slug], name="train", kind="training", gpu_required=gpus, gpu_type="nvidia", **fields)


def replica(svc, rank) -> Task:
    return Task.objects.get(group_id=svc.pk, rank=rank)


def decisions(svc) -> list[tuple[str, str]]:
    rows = ServiceDecision.objects.filter(service_id=svc.pk, source="lending").order_by("id")
    return list(rows.values_list("action", "reason"))


def test_a_lending_round_then_a_reclaim_round_through_the_real_cycle(world, n1):
    chat = serving(world, replicas=2, min_replicas=1, max_replicas=2)
    train = training(world)

    # lending: the training does not fit; the idle service lends its highest rank
    result = run_cycle()
    assert result.bound == [] and train.pk in result.loans
    train.refresh_from_db()
    assert train.status == "pending" and train.schedule_reason["code"] == "LoanPending"
    assert train.schedule_reason["cause"] == "InsufficientResources"
    loan_reason = train.schedule_reason["loan"]
    assert loan_reason["node_id"] == "n1" and loan_reason["replicas"] == [replica(chat, 1).pk]
    assert loan_reason["services"] == [{"service_id": chat.pk, "name": "chat", "replicas": 1, "sleeps": False}]
    chat = service(chat.pk)
    assert chat.replicas == 1 and chat.state == "running"
    assert replica(chat, 1).status == "stopping" and replica(chat, 0).status == "running"
    [(action, reason)] = decisions(chat)
    assert action == "borrowed" and f"training task {train.pk} (train)" in reason and "scaled 2 → 1" in reason
    loan = ServiceLoan.objects.get(service=chat)
    assert (loan.state, loan.borrower_id, loan.from_replicas, loan.to_replicas) == ("open", train.pk, 2, 1)

    # the cards stay counted until the agent confirms; the training waits, nothing is lent twice
    assert run_cycle().bound == [] and ServiceLoan.objects.count() == 1
    train.refresh_from_db()
    assert train.schedule_reason["code"] == "LoanPending"
    confirm(replica(chat, 1).pk, "stopping", "stopped")
    assert run_cycle().bound == [train.pk] and ledger_agrees()
    train.refresh_from_db()
    assert train.node_id == "n1"
    assert lending_patrol_job() == "ran"
    loan.refresh_from_db()
    assert loan.state == "open" and loan.bound_at is not None  # no traffic: the loan stands

    # reclaim: traffic again (the gateway's reading needs more than the one replica left)
    confirm(train.pk, "scheduled", "running")
    in_flight(chat, 20)
    patrol = lending.patrol_round()
    assert patrol.preempted == [train.pk] and list(patrol.returned) == [loan.pk]
    chat = service(chat.pk)
    assert chat.replicas == 2 and replica(chat, 1).status == "pending"
    assert [action for action, _ in decisions(chat)] == ["borrowed", "returned"]
    assert "traffic" in decisions(chat)[-1][1]
    train.refresh_from_db()
    assert train.status == "preempting"  # the normal graceful stop: the agent checkpoints and confirms
    assert GpuAllocation.objects.filter(task=train).exists()
    loan.refresh_from_db()
    assert loan.state == "returned" and "traffic" in loan.returned_why
    confirm(train.pk, "preempting", "pending")
    result = run_cycle()
    assert result.bound == [replica(chat, 1).pk]
    # the service is busy now: the training waits, nothing is lent
    assert train.pk not in result.loans and result.failed[train.pk]["code"] == "InsufficientResources"
    assert ledger_agrees()


def test_the_trainings_end_gives_the_cards_back(world, n1):
    chat = serving(world, replicas=2, min_replicas=1, max_replicas=2)
    train = training(world)
    run_cycle()
    confirm(replica(chat, 1).pk, "stopping", "stopped")
    assert run_cycle().bound == [train.pk]
    assert lending.patrol_round().returned == {}
    train.refresh_from_db()
    confirm(train.pk, "scheduled", "running")
    stop_task(train)  # a user's stop
    confirm(train.pk, "stopping", "stopped")
    patrol = lending.patrol_round()
    assert patrol.preempted == [] and list(patrol.returned.values()) == [f"training task {train.pk} is stopped"]
    chat = service(chat.pk)
    assert chat.replicas == 2 and replica(chat, 1).status == "pending"
    assert run_cycle().bound == [replica(chat, 1).pk]


def test_a_service_idle_to_zero_is_put_to_sleep_and_a_request_reclaims_it(world, n1):
    chat = serving(world, replicas=2)  # min 2: only sleeping lends
    train = training(world, gpus=2)
    run_cycle()
    chat = service(chat.pk)
    assert chat.state == "sleeping" and chat.replicas == 2
    loan = ServiceLoan.objects.get(service=chat)
    assert loan.sleeps and (loan.from_replicas, loan.to_replicas) == (2, 0)
    assert [a for a, _ in decisions(chat)] == ["borrowed"] and "put to sleep" in decisions(chat)[0][1]
    for rank in (0, 1):
        confirm(replica(chat, rank).pk, "stopping", "stopped")
    assert run_cycle().bound == [train.pk]
    confirm(train.pk, "scheduled", "running")
    assert lending.patrol_round().returned == {}

    # a request through the gateway wakes it (the wake job), which is traffic
    assert wake_service_job(chat.pk) == "woken"
    patrol = lending.patrol_round()
    assert patrol.preempted == [train.pk]
    assert "woken" in patrol.returned[loan.pk]
    train.refresh_from_db()
    assert train.status == "preempting"


def test_a_borrower_that_never_gets_the_cards_gives_them_back_after_the_bind_timeout(world, n1):
    chat = serving(world, replicas=2, min_replicas=1, max_replicas=2)
    train = training(world)
    run_cycle()
    loan = ServiceLoan.objects.get(service=chat)
    assert lending.patrol_round(now=loan.created_at + timedelta(seconds=60)).returned == {}
    patrol = lending.patrol_round(now=loan.created_at + lending.BIND_TIMEOUT)
    assert "was not placed on the lent cards" in patrol.returned[loan.pk]
    assert service(chat.pk).replicas == 2
    train.refresh_from_db()
    assert train.status == "pending"


def test_a_service_that_is_not_lendable_or_not_idle_lends_nothing(world, n1):
    busy = serving(world, replicas=2, min_replicas=1, max_replicas=2)
    in_flight(busy, 9)  # needs 2 at the default target of 8 in flight
    train = training(world)
    assert run_cycle().loans == {}
    in_flight(busy, None)  # no reading: not known to be idle
    assert run_cycle().loans == {}
    InferenceService.objects.filter(pk=busy.pk).update(lendable=False)
    in_flight(busy, 0)
    result = run_cycle()
    assert result.loans == {} and result.failed[train.pk]["code"] == "InsufficientResources"
    assert service(busy.pk).replicas == 2 and not ServiceLoan.objects.exists()


def test_the_operators_cap_bounds_what_one_service_lends(world):
    make_node("n1", gpus=3)
    chat = serving(world, replicas=3, min_replicas=1, max_replicas=3)
    training(world, gpus=2)
    with override_settings(HETEROFLOW_INFERENCE_LEND_MAX_REPLICAS=1):
        assert run_cycle().loans == {}  # two replicas needed, one may be lent
    with override_settings(HETEROFLOW_INFERENCE_LEND_MAX_REPLICAS=0):
        assert run_cycle().loans == {}
    with override_settings(HETEROFLOW_INFERENCE_LEND_MAX_REPLICAS=2):
        assert len(run_cycle().loans) == 1
    assert service(chat.pk).replicas == 1


def test_another_tenants_idle_replicas_are_never_lent_a_tenant_groups_may_be(world, n1):
    chat = serving(world, "acme", replicas=2, min_replicas=1, max_replicas=2)
    train = training(world, "beta")
    result = run_cycle()
    assert result.loans == {} and result.failed[train.pk]["code"] == "InsufficientResources"
    assert service(chat.pk).replicas == 2 and not ServiceLoan.objects.exists()
    group = save_group(None, name="partners", tenants=[world.tenants["acme"], world.tenants["beta"]])
    try:
        result = run_cycle()
        assert train.pk in result.loans
        assert ServiceLoan.objects.get(service=chat).borrower_id == train.pk
    finally:
        group.delete()


def test_a_job_never_borrows(world, n1):
    serving(world, replicas=2, min_replicas=1, max_replicas=2)
    job = make_task(world.tenants["acme"], name="job", gpu_required=1, gpu_type="nvidia")
    result = run_cycle()
    assert result.loans == {} and job.pk in result.failed


def test_the_patrol_job_is_guarded_and_runs(world):
    assert lending_patrol_job() == "ran"


def test_lendable_is_a_service_field_defaulting_to_true_and_validated(api, world, n1):
    make_model(world.tenants["acme"])
    key = bearer(world.keys["acme-member"])
    before = InferenceService.objects.count()
    bad = api.post("/api/v1/inference-services", body(lendable="maybe"), format="json", **key)
    assert bad.status_code == 400 and "lendable" in bad.json()["error"]["fields"]
    assert InferenceService.objects.count() == before
    made = api.post("/api/v1/inference-services", body(name="private", lendable=False), format="json", **key)
    assert made.status_code == 201 and made.json()["lendable"] is False
    assert InferenceService.objects.get(pk=made.json()["id"]).lendable is False
    default = api.post("/api/v1/inference-services", body(name="open"), format="json", **key)
    assert default.json()["lendable"] is True


def test_explain_shows_the_loan_while_it_waits_and_once_it_holds_the_cards(api, world, n1):
    chat = serving(world, replicas=2, min_replicas=1, max_replicas=2)
    train = training(world)
    run_cycle()
    key = bearer(world.keys["acme-member"])
    waiting = api.get(f"/api/v1/tasks/{train.pk}/explain", **key).json()
    assert waiting["schedule_reason"]["code"] == "LoanPending"
    assert [loan["service_id"] for loan in waiting["loans"]] == [chat.pk]  # open from the moment it is lent
    words = " ".join(explain_words(waiting))
    assert "idle inference replicas of its tenant are stopping" in words
    assert f"borrowing on n1 from chat (service {chat.pk}): 1 replica" in words
    confirm(replica(chat, 1).pk, "stopping", "stopped")
    run_cycle()
    holding = api.get(f"/api/v1/tasks/{train.pk}/explain", **key).json()
    [loan] = holding["loans"]
    assert (loan["service_id"], loan["name"], loan["replicas"], loan["state"]) == (chat.pk, "chat", 1, "open")
    assert "It holds cards lent by chat" in " ".join(explain_words(holding))
    detail = api.get(f"/api/v1/inference-services/{chat.pk}", **key).json()
    assert [row["borrower_id"] for row in detail["loans"]] == [train.pk]
    decisions_api = api.get(f"/api/v1/inference-services/{chat.pk}/decisions?source=lending", **key).json()
    assert [row["action"] for row in decisions_api["results"]] == ["borrowed"]
    # another tenant does not see the task, nor its loans
    assert api.get(f"/api/v1/tasks/{train.pk}/explain", **bearer(world.keys["beta-member"])).status_code == 404


def test_a_borrower_placed_elsewhere_first_gives_the_lent_cards_back(world, n1):
    chat = serving(world, replicas=2, min_replicas=1, max_replicas=2)
    make_node("n2", gpus=1)
    job = make_task(world.tenants["beta"], name="job", gpu_required=1, gpu_type="nvidia")
    run_cycle()
    confirm(job.pk, "scheduled", "running")
    train = training(world)
    assert train.pk in run_cycle().loans  # n1's replica lends; n2 is full
    confirm(job.pk, "running", "completed")  # n2 frees up before the replica has stopped
    assert run_cycle().bound == [train.pk]
    train.refresh_from_db()
    assert train.node_id == "n2"
    patrol = lending.patrol_round()
    assert list(patrol.returned.values()) == [f"training task {train.pk} was placed on n2, not on the lent cards of n1"]
    assert patrol.preempted == [] and service(chat.pk).replicas == 2


def test_a_training_group_borrows_and_is_preempted_whole_on_traffic(world, n1):
    chat = serving(world, replicas=2, min_replicas=1, max_replicas=2)
    gang = make_group(world.tenants["acme"], workers=2, gpus=1, name="gang", kind="training")
    result = run_cycle()
    assert gang.pk in result.group_loans and result.bound == []
    gang.refresh_from_db()
    assert gang.schedule_reason["code"] == "LoanPending" and gang.schedule_reason["loan"]["nodes"] == ["n1"]
    chat = service(chat.pk)
    assert chat.state == "sleeping"  # both replicas lent
    [(action, reason)] = decisions(chat)
    assert action == "borrowed" and f"training task group {gang.pk} (gang)" in reason
    loan = ServiceLoan.objects.get(service=chat)
    assert loan.borrower_group_id == gang.pk and loan.sleeps
    assert run_cycle().group_loans[gang.pk]["services"][0]["service_id"] == chat.pk  # waiting, not lent again
    for rank in (0, 1):
        confirm(replica(chat, rank).pk, "stopping", "stopped")
    assert run_cycle().groups_bound == [gang.pk] and ledger_agrees()
    members = list(Task.objects.filter(group=gang).order_by("rank"))
    for member in members:
        confirm(member.pk, "scheduled", "running")
    assert lending.patrol_round().returned == {}
    assert wake_service_job(chat.pk) == "woken"
    patrol = lending.patrol_round()
    assert sorted(patrol.preempted) == [member.pk for member in members]
    assert "woken" in patrol.returned[loan.pk]
    assert set(Task.objects.filter(group=gang).values_list("status", flat=True)) == {"preempting"}
    for member in members:  # each agent's graceful stop: the gang goes back to the queue whole
        confirm(member.pk, "preempting", "pending")
    assert set(Task.objects.filter(group=gang).values_list("status", flat=True)) == {"pending"}
    assert run_cycle().bound == [replica(chat, 0).pk, replica(chat, 1).pk]  # the woken replicas first


def test_group_explain_shows_the_groups_loan(api, world, n1):
    serving(world, replicas=2, min_replicas=1, max_replicas=2)
    gang = make_group(world.tenants["acme"], workers=2, gpus=1, name="gang", kind="training")
    run_cycle()
    answer = api.get(f"/api/v1/task-groups/{gang.pk}/explain", **bearer(world.keys["acme-member"])).json()
    assert answer["schedule_reason"]["code"] == "LoanPending"
    [loan] = answer["loans"]
    assert (loan["borrower_group_id"], loan["replicas"], loan["sleeps"]) == (gang.pk, 2, True)


def test_the_admin_shows_a_services_loans(client, world, n1):
    chat = serving(world, replicas=2, min_replicas=1, max_replicas=2)
    train = training(world)
    run_cycle()
    client.force_login(world.operator)
    html = client.get(f"/admin/inference/inferenceservice/{chat.pk}/change/").content.decode()
    assert "service loans" in html.lower()
    loans = html.lower().split("service loans", 1)[1]
    assert str(train) in html and "open" in loans and "n1" in loans
