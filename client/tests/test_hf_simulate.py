"""`hf simulate`: the work, fleet and policies read locally and sent as one request; the
replay followed until it ends; the figures as a table; the report and charts saved with
--out; the refusals before anything is sent."""

from __future__ import annotations

import json

from hf_fakeapi import Answer, error, streaming

PNG = b"\x89PNG\r\n\x1a\nfake"
RUN = {
    "policy": "binpack",
    "jobs": 10,
    "placed": 10,
    "utilisation_mean": 0.42,
    "wait_seconds": {"p50": 60.0, "p90": 600.0, "p99": None},
    "fragmentation": {"idle_cards_on_partly_used_nodes_mean": 3.5},
}


def png(request, match, http):
    http.send_response(200)
    http.send_header("Content-Type", "image/png")
    http.send_header("Content-Length", str(len(PNG)))
    http.end_headers()
    http.wfile.write(PNG)


def test_hf_simulate_sends_the_files_follows_the_run_and_saves_what_it_made(hf, fakeapi, tmp_path, monkeypatch):
    import heteroflow_client.cli as cli

    monkeypatch.setattr(cli.time, "sleep", lambda seconds: None)
    (tmp_path / "fleet.yaml").write_text("nodes:\n  - {name: n, count: 2, gpus: 8}\n")
    (tmp_path / "binpack.yaml").write_text("layout: binpack\n")
    states = iter([{"state": "running", "progress": 0.5}, {"state": "done", "progress": 1.0}])
    chart = "/api/v1/admin/simulations/7/charts/utilisation.png"

    def progress(request, match):
        found = next(states)
        report = {"runs": [RUN]} if found["state"] == "done" else None
        return Answer(200, {"id": 7, **found, "report": report, "charts": [chart] if report else [], "error": ""})

    fakeapi.route("POST", "/api/v1/admin/simulations", lambda r, m: Answer(202, {"id": 7, "state": "queued"}))
    fakeapi.route("GET", "/api/v1/admin/simulations/7", progress)
    fakeapi.route("GET", chart, streaming(png))
    out = tmp_path / "out"
    code, printed, err = hf(
        "simulate",
        "--generate", "10",
        "--days", "0.5",
        "--fleet", str(tmp_path / "fleet.yaml"),
        "--policy", str(tmp_path / "binpack.yaml"),
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    sent = fakeapi.got("POST", "/api/v1/admin/simulations")[0].body
    assert sent == {
        "work": {"generate": {"jobs": 10, "days": 0.5, "seed": 1}},
        "fleet": {"nodes": [{"name": "n", "count": 2, "gpus": 8}]},
        "policies": [{"layout": "binpack", "name": "binpack"}],
    }
    assert "binpack" in printed and "10/10" in printed and "42.0%" in printed and "10.0m" in printed
    assert json.loads((out / "report.json").read_text()) == {"runs": [RUN]}
    assert (out / "utilisation.png").read_bytes() == PNG


def test_hf_simulate_says_why_a_run_failed_and_refuses_bad_input_before_sending(hf, fakeapi, tmp_path, monkeypatch):
    import heteroflow_client.cli as cli

    monkeypatch.setattr(cli.time, "sleep", lambda seconds: None)
    code, _, err = hf("simulate")
    assert code == 2 and "exactly one of --history, --generate and -f" in err
    code, _, err = hf("simulate", "--history", "soon")
    assert code == 2 and "7d, 36h or 90m" in err
    (tmp_path / "trace.jsonl").write_text('{"submit": 0, "gpus": 1, "duration": 5}\nnot json\n')
    code, _, err = hf("simulate", "-f", str(tmp_path / "trace.jsonl"))
    assert code == 2 and "line 2: not JSON" in err
    assert fakeapi.got("POST") == []

    fakeapi.route(
        "POST",
        "/api/v1/admin/simulations",
        lambda r, m: error(400, "invalid", "Invalid input.", {"request": ["row 3: missing duration."]}),
    )
    (tmp_path / "trace.jsonl").write_text('{"submit": 0, "gpus": 1}\n')
    code, _, err = hf("simulate", "-f", str(tmp_path / "trace.jsonl"))
    assert code == 1 and "row 3: missing duration." in err

    fakeapi.route("POST", "/api/v1/admin/simulations", lambda r, m: Answer(202, {"id": 8, "state": "queued"}))
    fakeapi.route(
        "GET",
        "/api/v1/admin/simulations/8",
        lambda r, m: Answer(200, {"id": 8, "state": "failed", "progress": 0.3, "error": "KeyError: 'x'"}),
    )
    code, _, err = hf("simulate", "--history", "7d")
    assert code == 1 and "Simulation 8 failed: KeyError: 'x'" in err
    assert fakeapi.got("POST")[-1].body["work"] == {"from_history_days": 7.0}
