"""Replaying work on a fleet (apps.scheduler.core.replay, the shell apps.scheduler.simulate,
manage.py simulate): exact starts on a scripted trace; gangs reserve and what declares a
short duration backfills; the first cycle of a replay places what a real scheduler cycle
places on the same snapshot; the trace readers (JSONL, CSV, the PAI trace) and the
generator; the command's report and charts, and its refusals."""

import json

import pytest
from django.core.management import CommandError, call_command

from apps.scheduler.core.replay import Job, Policy, ReplayFleet, replay, summary
from apps.scheduler.models import GpuAllocation
from apps.scheduler.queue import pending_request
from apps.scheduler.services import run_cycle
from apps.scheduler.simulate import SimulationInputError, fleet_from_yaml, policy_from_yaml, policy_of_cluster
from apps.scheduler.snapshot import load_nodes
from apps.scheduler.traces import SHAPES, Tenants, TraceError, generate, read_pai, read_trace, write_trace
from tests.factories import make_node, make_task
from tests.scheduler.snapshots import node

ONE_NODE = [node("n0", 8)]
POLICY = Policy(cycle_seconds=10)


def job(id, submit, gpus, duration, **kw):
    return Job(id=id, submit=submit, tenant_id=kw.pop("tenant", 1), gpus=gpus, duration=duration, **kw)


def starts(report) -> dict[int, float | None]:
    return {job_id: outcome.start for job_id, outcome in report.outcomes.items()}


def test_work_starts_at_the_first_cycle_with_room_and_leaves_when_its_time_is_up():
    trace = [job(1, 0, 8, 100), job(2, 5, 4, 50), job(3, 7, 4, 30)]
    report = replay(trace, ONE_NODE, POLICY)
    # cycles every 10 s from the first arrival: job 1 at 0; 2 and 3 wait for its cards, freed at 100
    assert starts(report) == {1: 0, 2: 100, 3: 100}
    assert report.outcomes[3].end == 130
    figures = summary(report)
    assert figures["placed"] == 3 and figures["wait_seconds"]["p99"] == 95.0
    assert ONE_NODE[0].gpus[0].holders == []  # the caller's fleet is untouched


def test_priority_goes_first_and_what_never_fits_is_reported():
    trace = [job(1, 0, 8, 100), job(2, 1, 8, 10, priority=50), job(3, 2, 8, 10, priority=90), job(4, 3, 16, 10)]
    report = replay(trace, ONE_NODE, POLICY)
    assert starts(report) == {1: 0, 3: 100, 2: 110, 4: None}
    assert summary(report)["never_placed"] == 1


def test_a_waiting_gang_reserves_and_only_work_that_declares_an_end_in_time_backfills():
    fleet = [node("a", 8), node("b", 8)]
    trace = [
        job(1, 0, 8, 1000, declared=1000),  # holds a
        job(2, 0, 4, 200, declared=200),  # half of b, until 200
        job(3, 10, 8, 100, workers=2),  # a gang of 2×8: waits for both nodes
        job(4, 400, 4, 100, declared=100),  # declares it ends by 500: before a frees up at 1000
        job(5, 400, 4, 5000),  # declares nothing: kept off the held cards
    ]
    report = replay(trace, fleet, Policy(cycle_seconds=10, reserve_after_seconds=60))
    got = starts(report)
    assert got[3] == 1000 and report.reservations > 0
    assert got[4] == 400  # backfilled
    assert got[5] >= 1100  # after the gang
    without = replay(trace, fleet, Policy(cycle_seconds=10, reserve_after_seconds=None))
    assert starts(without)[5] == 400 and starts(without)[3] > 1000  # no reservation: the gang starves behind it


@pytest.mark.django_db
def test_the_first_cycle_of_a_replay_places_what_a_real_cycle_places(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    for number in range(4):
        make_node(f"n{number}", gpus=8, zone=f"z{number % 2}", rack=f"r{number}")
    make_node("amd", gpus=4, vendor="amd")
    pending = [
        make_task(acme, name="a", gpu_required=4, priority=60),
        make_task(beta, name="b", gpu_required=8),
        make_task(acme, name="c", gpu_required=2, gpu_type="amd"),
        make_task(beta, name="d", gpu_required=3, labels={"zone": "z1"}),
        make_task(acme, name="e", gpu_required=8),
        make_task(acme, name="f", gpu_required=8),
        make_task(beta, name="g", gpu_required=1),
    ]
    # as the scheduler's queue reads them, in its order
    queue = [pending_request(t) for t in sorted(pending, key=lambda t: (-t.priority, t.created_at, t.pk))]
    policy = policy_of_cluster()
    run = ReplayFleet([*load_nodes()], policy, lambda a, b: True)
    simulated = {d.task_id: (d.node_id, sorted(d.gpu_indices)) for d in run.place(queue, {}, 0.0).decisions}
    run_cycle()
    real = {}
    for allocation in GpuAllocation.objects.all():
        node_id, cards = real.setdefault(allocation.task_id, (allocation.node_id, []))
        cards.append(allocation.gpu_index)
    assert {task: (node_id, sorted(cards)) for task, (node_id, cards) in real.items()} == simulated
    assert len(simulated) >= 5


# --- traces --------------------------------------------------------------------------------------


def test_a_jsonl_and_a_csv_trace_read_the_same_and_a_bad_line_is_named(tmp_path):
    tenants = Tenants()
    (tmp_path / "t.jsonl").write_text(
        '{"submit": 0, "tenant": "acme", "gpus": 2, "duration": 60}\n\n'
        '{"submit": 5.5, "tenant": "beta", "gpus": 8, "duration": 600, "workers": 2, "priority": 70, '
        '"gpu_type": "Ascend", "declared": 900}\n'
    )
    (tmp_path / "t.csv").write_text(
        "submit,tenant,gpus,duration,workers,priority,gpu_type,declared\n0,acme,2,60,,,,\n5.5,beta,8,600,2,70,Ascend,900\n"
    )
    from_json = read_trace(tmp_path / "t.jsonl", tenants)
    assert read_trace(tmp_path / "t.csv", tenants) == from_json
    assert from_json[1] == Job(2, 5.5, 2, 8, 600.0, gpu_type="ascend", priority=70, workers=2, declared=900.0)
    write_trace(from_json, tmp_path / "back.jsonl", tenants)
    assert read_trace(tmp_path / "back.jsonl", tenants) == from_json
    for text, words in [
        ('{"submit": 0, "gpus": 1}\n', "line 1: missing duration"),
        ('{"submit": 0, "gpus": 1, "duration": 5, "colour": "red"}\n', "line 1: unknown colour"),
        ('{"submit": 0, "gpus": 1, "duration": 5}\n{"submit": -1, "gpus": 1, "duration": 5}\n', "line 2:"),
        ("[1, 2]\n", "line 1: an object is expected"),
        ("not json\n", "line 1: not JSON"),
        ("\n", "no work in it"),
    ]:
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(TraceError, match=words.replace("(", r"\(")):
            read_trace(tmp_path / "bad.jsonl", tenants)


def test_the_pai_trace_imports_its_gpu_tasks_as_jobs_and_counts_what_it_skips(tmp_path):
    # pai_task_table.csv and pai_job_table.csv as published: no header, these columns
    (tmp_path / "pai_task_table.csv").write_text(
        "j1,worker,2,Terminated,1000,1600,600,29.3,100,V100\n"
        "j2,worker,1,Terminated,1100,1400,600,29.3,50,T4\n"  # half a card: one card
        "j3,ps,1,Terminated,1200,1300,600,29.3,,\n"  # no GPU
        "j4,worker,1,Failed,1300,1400,600,29.3,100,V100\n"
        "j5,worker,1,Terminated,1500,,600,29.3,100,V100\n"  # no end
        "j6,worker,1,Terminated,2000,2600,600,29.3,800,MISC\n"
    )
    (tmp_path / "pai_job_table.csv").write_text(
        "j1,inst1,alice,Terminated,1000,1600\nj2,inst2,bob,Terminated,1100,1400\nj6,inst6,alice,Terminated,2000,2600\n"
    )
    tenants = Tenants()
    imported = read_pai(tmp_path / "pai_task_table.csv", tenants, tmp_path / "pai_job_table.csv")
    assert [(j.submit, j.gpus, j.workers, j.duration, tenants.name(j.tenant_id)) for j in imported.jobs] == [
        (0.0, 1, 2, 600.0, "alice"),
        (100.0, 1, 1, 300.0, "bob"),
        (1000.0, 8, 1, 600.0, "alice"),
    ]
    assert imported.skipped == {"no GPU": 1, "status Failed": 1, "unreadable numbers": 1}


def test_the_generated_trace_is_repeatable_and_has_its_documented_shape():
    first = generate(4000, 2, {"nvidia": 800, "ascend": 200}, Tenants(), seed=7)
    assert first == generate(4000, 2, {"nvidia": 800, "ascend": 200}, Tenants(), seed=7)
    assert first != generate(4000, 2, {"nvidia": 800, "ascend": 200}, Tenants(), seed=8)
    assert all(0 <= j.submit < 2 * 86400 for j in first)
    single = sum(1 for j in first if j.gpus == 1 and j.workers == 1) / len(first)
    assert abs(single - SHAPES[0][2]) < 0.03  # mostly one card
    assert sum(1 for j in first if j.workers > 1) / len(first) == pytest.approx(0.05, abs=0.015)
    durations = sorted(j.duration for j in first)
    assert 1400 < durations[len(durations) // 2] < 2300  # median about 30 minutes
    assert sum(durations) / len(durations) > 2 * durations[len(durations) // 2]  # heavy tail
    ascend = sum(1 for j in first if j.gpu_type == "ascend") / len(first)
    assert ascend == pytest.approx(0.2, abs=0.03)


# --- the shell and the command ----------------------------------------------------------------------


def test_fleet_and_policy_descriptions_read_and_refuse_clearly(tmp_path):
    (tmp_path / "fleet.yaml").write_text(
        "nodes:\n  - {name: a100, count: 4, gpus: 8, zones: [z1, z2], racks_per_zone: 2}\n"
        "  - {name: ascend, count: 1, gpus: 8, vendor: ascend}\n"
    )
    fleet = fleet_from_yaml(tmp_path / "fleet.yaml")
    assert [n.id for n in fleet] == ["a100-1", "a100-2", "a100-3", "a100-4", "ascend-1"]
    assert [(n.zone, n.rack) for n in fleet[:4]] == [("z1", "z1-r1"), ("z2", "z2-r1"), ("z1", "z1-r2"), ("z2", "z2-r2")]
    assert fleet[4].gpus[0].vendor == "ascend"
    (tmp_path / "policy.yaml").write_text(
        "name: fair\nlayout: binpack\nreserve_after_seconds: null\n"
        "fair_share: {half_life_days: 1, queues: {acme: {weight: 2, cohort: all, nominal: {nvidia: 16}}}}\n"
    )
    tenants = Tenants()
    policy = policy_from_yaml(tmp_path / "policy.yaml", tenants)
    assert policy.settings.layout == "binpack" and policy.reserve_after_seconds is None
    assert policy.specs[0].weight == 2 and policy.specs[0].quota("nvidia").nominal == 16
    assert policy.half_life_seconds == 86400
    for path, text, words in [
        ("f.yaml", "nodes: []\n", "a list `nodes:`"),
        ("f.yaml", "nodes:\n  - {name: x, count: 1, gpus: 8, vendor: tpu}\n", "vendor 'tpu'"),
        ("f.yaml", "nodes:\n  - {name: x, count: 1}\n", "name, count and gpus are required"),
        ("p.yaml", "layout: diagonal\n", "layout is spread or binpack"),
        ("p.yaml", "colour: red\n", "unknown colour"),
    ]:
        (tmp_path / path).write_text(text)
        reader = fleet_from_yaml if path == "f.yaml" else (lambda p: policy_from_yaml(p, Tenants()))
        with pytest.raises(SimulationInputError, match=words):
            reader(tmp_path / path)


def test_the_command_compares_two_policies_and_writes_the_report_and_charts(tmp_path, capsys):
    (tmp_path / "fleet.yaml").write_text("nodes:\n  - {name: n, count: 20, gpus: 8}\n")
    (tmp_path / "binpack.yaml").write_text("name: binpack\nlayout: binpack\n")
    (tmp_path / "spread.yaml").write_text("name: spread\nlayout: spread\n")
    out = tmp_path / "out"
    call_command(
        "simulate",
        "--fleet",
        str(tmp_path / "fleet.yaml"),
        "--generate",
        "300",
        "--days",
        "0.5",
        "--policy",
        str(tmp_path / "binpack.yaml"),
        "--compare",
        str(tmp_path / "spread.yaml"),
        "--save-trace",
        str(tmp_path / "trace.jsonl"),
        "--out",
        str(out),
    )
    printed = capsys.readouterr().out
    assert "fleet: 20 nodes, 160 cards; work: 300 jobs" in printed
    assert "binpack: 300/300 placed" in printed and "spread: 300/300 placed" in printed
    report = json.loads((out / "report.json").read_text())
    assert [run["policy"] for run in report["runs"]] == ["binpack", "spread"]
    assert set(report["runs"][0]["wait_seconds_by_tenant"]) <= {"tenant-1", "tenant-2", "tenant-3", "tenant-4"}
    assert report["runs"][0]["utilisation"] and report["runs"][0]["preemptions"] == 0
    for chart in ("utilisation.png", "waits.png", "fragmentation.png"):
        assert (out / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the saved trace replays to the same figures
    call_command(
        "simulate",
        "--fleet",
        str(tmp_path / "fleet.yaml"),
        "--trace",
        str(tmp_path / "trace.jsonl"),
        "--policy",
        str(tmp_path / "binpack.yaml"),
        "--out",
        str(tmp_path / "again"),
        "--no-charts",
    )
    again = json.loads((tmp_path / "again" / "report.json").read_text())["runs"][0]
    assert again["wait_seconds"] == report["runs"][0]["wait_seconds"]


def test_the_command_refuses_bad_input_before_it_runs(tmp_path):
    (tmp_path / "fleet.yaml").write_text("nodes:\n  - {name: n, count: 2, gpus: 8}\n")
    (tmp_path / "bad.jsonl").write_text('{"submit": 0}\n')
    with pytest.raises(CommandError, match="line 1: missing"):
        call_command(
            "simulate",
            "--fleet",
            str(tmp_path / "fleet.yaml"),
            "--trace",
            str(tmp_path / "bad.jsonl"),
            "--out",
            str(tmp_path / "out"),
        )
    with pytest.raises(CommandError, match="a duration such as 7d"):
        call_command(
            "simulate",
            "--fleet",
            str(tmp_path / "fleet.yaml"),
            "--from-history",
            "soon",
            "--out",
            str(tmp_path / "out"),
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.django_db
def test_this_clusters_history_replays_on_this_cluster(tmp_path, world, capsys):
    from datetime import timedelta

    from apps.core.clock import utcnow

    acme = world.tenants["acme"]
    make_node("n1", gpus=8)
    now = utcnow()
    for number in range(3):
        task = make_task(
            acme,
            name=f"t{number}",
            gpu_required=2,
            status="completed",
            started_at=now - timedelta(hours=2),
            finished_at=now - timedelta(hours=1),
        )
        type(task).objects.filter(pk=task.pk).update(created_at=now - timedelta(hours=3))
    call_command("simulate", "--from-history", "1d", "--out", str(tmp_path), "--no-charts")
    printed = capsys.readouterr().out
    assert "fleet: 1 nodes, 8 cards; work: 3 jobs" in printed and "this cluster: 3/3 placed" in printed
    report = json.loads((tmp_path / "report.json").read_text())["runs"][0]
    assert report["wait_seconds_by_tenant"]["acme"]["jobs"] == 3
