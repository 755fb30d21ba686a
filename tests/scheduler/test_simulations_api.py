"""Replays through the API (apps.scheduler.simulations, /api/v1/admin/simulations): a
request checked whole (400, nothing written), queued, run by the job with its progress
and then its report and charts; operators only; the sweep sends again what a lost message
left queued and fails what a dead worker left running; a claimed run is never run twice."""

from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.scheduler import simulations
from apps.scheduler.models import Simulation
from tests.factories import make_node
from tests.headers import bearer

pytestmark = pytest.mark.django_db

URL = "/api/v1/admin/simulations"
FLEET = {"nodes": [{"name": "n", "count": 10, "gpus": 8}]}
REQUEST = {
    "work": {"generate": {"jobs": 200, "days": 0.5, "seed": 3}},
    "fleet": FLEET,
    "policies": [{"name": "binpack", "layout": "binpack"}, {"name": "spread", "layout": "spread"}],
}


@pytest.fixture
def sent(monkeypatch):
    asked = []
    monkeypatch.setattr(simulations, "enqueue", lambda name, *args: asked.append((name, args)))
    return asked


def test_a_replay_is_queued_run_and_read_with_its_report_and_charts(api, world, sent):
    key = bearer(world.operator_key)
    answer = api.post(URL, REQUEST, format="json", **key)
    assert answer.status_code == 202, answer.json()
    body = answer.json()
    assert body["state"] == "queued" and body["report"] is None and body["charts"] == []
    assert sent == [("scheduler.simulate", (body["id"],))]

    assert simulations.run(body["id"]) == "done"
    assert simulations.run(body["id"]) == "not queued"  # claimed once
    done = api.get(f"{URL}/{body['id']}", **key).json()
    assert done["state"] == "done" and done["progress"] == 1.0 and done["error"] == ""
    assert [run["policy"] for run in done["report"]["runs"]] == ["binpack", "spread"]
    assert all(run["placed"] == 200 for run in done["report"]["runs"])
    assert done["charts"] == [
        f"{URL}/{body['id']}/charts/{name}.png" for name in ("fragmentation", "utilisation", "waits")
    ]
    chart = api.get(done["charts"][0], **key)
    assert chart.status_code == 200 and chart["Content-Type"] == "image/png" and chart.content[:4] == b"\x89PNG"
    assert api.get(f"{URL}/{body['id']}/charts/colour.png", **key).status_code == 404
    listed = api.get(URL, **key).json()["results"]
    assert [row["id"] for row in listed] == [body["id"]] and "report" not in listed[0]


def test_this_clusters_fleet_and_policy_when_none_is_given(api, world, sent):
    make_node("n1", gpus=8)
    answer = api.post(
        URL, {"work": {"generate": {"jobs": 20, "days": 0.1}}}, format="json", **bearer(world.operator_key)
    )
    assert answer.status_code == 202
    simulations.run(answer.json()["id"])
    report = Simulation.objects.get().report
    assert report["runs"][0]["policy"] == "this cluster" and report["runs"][0]["jobs"] == 20


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"work": {}}, "exactly one of"),
        ({"work": {"from_history_days": 1, "generate": {"jobs": 5}}}, "exactly one of"),
        ({"work": {"generate": {"jobs": 5}}, "colour": "red"}, "Unknown field"),
        ({"work": {"generate": {"jobs": 0}}}, "greater than or equal to 1"),
        ({"work": {"trace": [{"submit": 0, "gpus": 1}]}, "fleet": FLEET}, "row 1: missing duration"),
        (
            {
                "work": {"generate": {"jobs": 5}},
                "fleet": {"nodes": [{"name": "x", "count": 1, "gpus": 8, "vendor": "tpu"}]},
            },
            "vendor 'tpu'",
        ),
        (
            {"work": {"generate": {"jobs": 5}}, "fleet": FLEET, "policies": [{"layout": "diagonal"}]},
            "layout is spread or binpack",
        ),
        ({"work": {"from_history_days": 1}, "fleet": FLEET}, "no work that ran"),
        ({"work": {"generate": {"jobs": 5}}}, "no schedulable node"),
    ],
)
def test_a_bad_request_says_what_is_wrong_and_writes_nothing(api, world, sent, body, words):
    answer = api.post(URL, body, format="json", **bearer(world.operator_key))
    assert answer.status_code == 400 and words in str(answer.json()), answer.json()
    assert not Simulation.objects.exists() and sent == []


def test_only_operators_replay(api, world, sent):
    for who in ("acme-admin", "acme-member"):
        assert api.post(URL, REQUEST, format="json", **bearer(world.keys[who])).status_code == 403
        assert api.get(URL, **bearer(world.keys[who])).status_code == 403
    assert not Simulation.objects.exists()


def test_the_sweep_sends_a_lost_run_again_and_fails_a_run_whose_worker_is_gone(world, sent):
    now = utcnow()
    lost = Simulation.objects.create(request=REQUEST)
    fresh = Simulation.objects.create(request=REQUEST)
    stale = Simulation.objects.create(request=REQUEST, state="running", moved_at=now - timedelta(hours=1))
    moving = Simulation.objects.create(request=REQUEST, state="running", moved_at=now - timedelta(minutes=1))
    Simulation.objects.filter(pk=lost.pk).update(created_at=now - timedelta(minutes=5))
    assert simulations.sweep(now) == 2
    assert sent == [("scheduler.simulate", (lost.pk,))]
    states = dict(Simulation.objects.values_list("pk", "state"))
    assert states == {lost.pk: "queued", fresh.pk: "queued", stale.pk: "failed", moving.pk: "running"}
    assert "no progress for 30 minutes" in Simulation.objects.get(pk=stale.pk).error


def test_a_replay_that_breaks_is_failed_with_why(world, sent, monkeypatch):
    simulation = Simulation.objects.create(request=REQUEST)

    def broken(*args, **kwargs):
        raise RuntimeError("the core broke")

    monkeypatch.setattr(simulations, "replay", broken)
    assert simulations.run(simulation.pk) == "failed"
    simulation.refresh_from_db()
    assert simulation.state == "failed" and simulation.error == "RuntimeError: the core broke"


def test_the_portal_queues_a_replay_shows_its_progress_then_its_figures_and_charts(client, world, sent):
    from tests.portal.client import signed_in

    make_node("n1", gpus=8)
    operator = signed_in(client, world.operator)
    form = {"work": "generate", "jobs": "40", "days": "0.2", "policy": "binpack", "compare": "spread"}
    answer = operator.post("/portal/queues/simulations/", form)
    simulation = Simulation.objects.get()
    assert answer.status_code == 302 and answer["Location"] == f"/portal/queues/simulations/{simulation.pk}/"
    assert simulation.request == {
        "work": {"generate": {"jobs": 40, "days": 0.2, "seed": 1}},
        "fleet": None,
        "policies": [{"name": "binpack", "layout": "binpack"}, {"name": "spread", "layout": "spread"}],
    }
    waiting = operator.get(answer["Location"]).content.decode()
    assert 'data-state="queued"' in waiting and 'http-equiv="refresh"' in waiting
    simulations.run(simulation.pk)
    done = operator.get(answer["Location"]).content.decode()
    assert 'data-state="done"' in done and 'http-equiv="refresh"' not in done
    assert 'data-run="binpack"' in done and 'data-run="spread"' in done and "/40</td>" in done  # placed of 40
    chart = operator.get(f"/portal/queues/simulations/{simulation.pk}/utilisation.png")
    assert chart.status_code == 200 and chart.content[:4] == b"\x89PNG"
    assert f'data-simulation="{simulation.pk}"' in operator.get("/portal/queues/simulations/").content.decode()

    refused = operator.post("/portal/queues/simulations/", {"work": "generate", "jobs": "0"}, follow=True)
    assert "Not queued: A generated trace has 1 to 200,000 jobs." in refused.content.decode()
    refused = operator.post("/portal/queues/simulations/", {"work": "history", "history_days": "many"}, follow=True)
    assert "Not queued:" in refused.content.decode() and Simulation.objects.count() == 1
    member = signed_in(client, world.users["acme-admin"])
    assert member.get("/portal/queues/simulations/").status_code == 403
    assert member.get(f"/portal/queues/simulations/{simulation.pk}/utilisation.png").status_code == 403
