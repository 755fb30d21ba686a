"""What people meet when something is wrong, and the exit status `hf` gives it: a wrong
or missing key (run `hf login`, 2), a server that cannot be reached (its URL and why, 2),
a refusal of the API (its message and fields, 1), never a traceback unless --debug; and
`hf run --follow` exiting with the task's own exit code."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from hf_fakeapi import Answer, end_chunks, error, line, lines_event, send_chunk, start_events, streaming

from heteroflow_client import __version__

CLIENT = Path(__file__).resolve().parents[1]


def test_a_wrong_key_says_to_log_in_and_exits_2(hf, fakeapi, monkeypatch):
    monkeypatch.setenv("HETEROFLOW_API_KEY", "sk-tenant-revoked")
    fakeapi.route("GET", "/api/v1/tasks", lambda r, m: error(401, "authentication_failed", "Invalid key."))
    code, out, err = hf("ps")
    assert code == 2
    assert "Invalid key." in err and "run `hf login`" in err and "Traceback" not in err


def test_no_key_at_all_says_to_log_in_and_exits_2(home):
    from click.testing import CliRunner

    from heteroflow_client.cli import cli

    result = CliRunner().invoke(cli, ["ps"])
    assert result.exit_code == 2 and "hf login" in result.stderr


def test_a_server_that_cannot_be_reached_is_named_with_the_cause_and_exits_2(hf, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("HETEROFLOW_URL", url)
    code, out, err = hf("ps")
    assert code == 2
    assert url in err and "refused" in err.lower() and "Traceback" not in err


def test_a_refusal_prints_the_message_and_fields_and_exits_1(hf, fakeapi):
    fakeapi.route(
        "POST",
        "/api/v1/tasks",
        lambda r, m: error(409, "quota_exceeded", "Quota of tenant 'acme' exceeded: 8 of 8 GPUs in use, 1 more asked."),
    )
    code, out, err = hf("run", "--image", "busybox", "--", "true")
    assert code == 1
    assert "Quota of tenant 'acme' exceeded" in err and "quota_exceeded" in err
    fakeapi.route(
        "POST", "/api/v1/tasks", lambda r, m: error(400, "invalid", "Invalid input.", {"env": ["No secret 'db'."]})
    )
    code, out, err = hf("run", "--image", "busybox", "--", "true")
    assert code == 1 and "env: No secret 'db'." in err


def test_debug_shows_the_traceback(hf, fakeapi):
    fakeapi.route("GET", "/api/v1/tasks/9", lambda r, m: error(404, "not_found", "Not found."))
    code, out, err = hf("show", "9")
    assert code == 1 and "Not found." in err and "Traceback" not in err
    code, out, err = hf("--debug", "show", "9")
    assert code == 1 and "Traceback" in err and "GET" in err


def task_routes(fakeapi, task: dict, events: list[str]):
    fakeapi.route("POST", "/api/v1/tasks", lambda r, m: Answer(201, {**task, "status": "pending"}))
    fakeapi.route("GET", f"/api/v1/tasks/{task['id']}", lambda r, m: Answer(200, task))

    def logs(request, match, http):
        if request.query.get("follow") != "true":  # a page: what the log holds
            http.send(Answer(200, {"lines": [], "next": 0, "status": task["status"], "log_tail": ""}))
            return
        start_events(http)
        for event in events:
            send_chunk(http, event)
        end_chunks(http)

    fakeapi.route("GET", f"/api/v1/tasks/{task['id']}/logs", streaming(logs))


def test_run_follow_prints_the_log_and_exits_with_the_tasks_exit_code(hf, fakeapi):
    task = {"id": 5, "name": "t", "status": "failed", "exit_code": 3, "started_at": "2026-12-01T10:00:00Z"}
    ended = "event: end\ndata: " + json.dumps({"status": "failed", "exit_code": 3}) + "\n\n"
    task_routes(fakeapi, task, [lines_event([line(1, "hello"), line(2, "oops", stream="stderr")]), ended])
    code, out, err = hf("run", "--image", "busybox", "--follow", "--", "sh", "-c", "exit 3")
    assert code == 3
    assert out.splitlines() == ["hello"] and "oops" in err and "task 5 queued" in err


def test_run_follow_of_a_task_that_never_started_exits_1_with_the_reason(hf, fakeapi):
    task = {
        "id": 6,
        "name": "t",
        "status": "failed",
        "exit_code": None,
        "started_at": None,
        "error_message": "image not found",
    }
    task_routes(fakeapi, task, ["event: end\ndata: " + json.dumps({"status": "failed", "exit_code": None}) + "\n\n"])
    code, out, err = hf("run", "--image", "nope", "--follow", "--", "true")
    assert code == 1
    assert "task 6 failed before it started: image not found" in err


def test_version_loads_no_http_yaml_or_table_library():
    probe = (
        "import sys; sys.argv = ['hf', '--version']\n"
        "from heteroflow_client.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('httpx', 'rich', 'yaml', 'jsonschema', 'django') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=CLIENT, check=True, env={"PATH": "/usr/bin"}
    ).stdout
    assert out.splitlines() == [f"hf {__version__}", "[]"]


def test_the_package_never_imports_the_server_or_the_agent():
    forbidden = {"django", "rest_framework", "apps", "heteroflow", "heteroflow_agent", "tests"}
    found = []
    for path in sorted((CLIENT / "heteroflow_client").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            found += [f"{path.name}: {name}" for name in names if name.split(".")[0] in forbidden]
    assert found == []
