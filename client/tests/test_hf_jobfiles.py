"""Job files: every document checked against the server's schema before anything is sent;
a problem named as file:line:column and field; a YAML syntax error at the parser's mark;
one problem anywhere and nothing is submitted."""

from __future__ import annotations

import textwrap

import pytest
from hf_fakeapi import KEY, Answer

from heteroflow_client import Client, jobfiles
from heteroflow_client.errors import ValidationError

TWO_GOOD = """\
kind: task
name: hello
image: busybox
task_kind: training
command: [echo, hi]
gpu_required: 0
---
kind: group
name: train
world_size: 2
gpu_type: nvidia
image: trainer:1
"""


def write(tmp_path, text: str, name: str = "jobs.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def created(fakeapi):
    """The stand-in API creates whatever it is sent (and remembers it)."""
    bodies = []

    def create(request, match):
        bodies.append((request.path, request.body))
        return Answer(201, {"id": len(bodies), "status": "pending", **request.body})

    for path in ("/api/v1/tasks", "/api/v1/tasks/batch", "/api/v1/task-groups", "/api/v1/inference-services"):
        fakeapi.route("POST", path, create)
    return bodies


@pytest.fixture
def client(home, fakeapi):
    with Client(url=fakeapi.url, key=KEY) as client:
        yield client


def test_a_valid_file_is_created_document_by_document_with_task_kind_as_kind(client, tmp_path, created):
    results = client.apply(write(tmp_path, TWO_GOOD))
    assert [type(r).__name__ for r in results] == ["Task", "TaskGroup"]
    assert created[0] == (
        "/api/v1/tasks",
        {"name": "hello", "image": "busybox", "kind": "training", "command": ["echo", "hi"], "gpu_required": 0},
    )
    assert created[1][0] == "/api/v1/task-groups" and "kind" not in created[1][1]


def test_an_unknown_field_in_the_second_document_stops_the_first_too(client, fakeapi, tmp_path, created):
    path = write(tmp_path, TWO_GOOD + "colour: red\n")
    with pytest.raises(ValidationError) as caught:
        client.apply(path)
    error = caught.value
    assert (error.file, error.line, error.column, error.field) == (path, 13, 1, "colour")
    assert "unknown field" in error.problem
    assert f"{path}:13:1: colour: unknown field" in str(error)
    assert created == []  # nothing was sent, not even the valid first document


def test_every_problem_is_listed_with_its_line_column_and_field(client, tmp_path, created):
    path = write(
        tmp_path,
        """\
        kind: task
        name: t
        image: busybox
        gpu_required: 65
        env:
          PORT: 8080
          1BAD: x
        volumes:
          - host: /data
            container: /data
            rw: true
        """,
    )
    with pytest.raises(ValidationError) as caught:
        client.apply(path)
    found = {(e.line, e.column, e.field) for e in caught.value.errors}
    assert (4, 15, "gpu_required") in found
    assert (6, 9, "env.PORT") in found
    assert (7, 3, "env.1BAD") in found
    assert (11, 5, "volumes[0].rw") in found
    port = next(e for e in caught.value.errors if e.field == "env.PORT")
    assert "quote it" in port.problem or "secret" in port.problem
    assert created == []


def test_a_missing_field_and_a_wrong_kind_are_named(client, tmp_path, created):
    path = write(tmp_path, "kind: group\nname: g\nworld_size: 2\nimage: x\n---\nkind: job\nname: x\n")
    with pytest.raises(ValidationError) as caught:
        client.apply(path)
    problems = [(e.line, e.field, e.problem) for e in caught.value.errors]
    assert (1, "gpu_type", "required field missing") in problems
    assert any(line == 6 and field == "kind" for line, field, _ in problems)
    assert created == []


def test_a_yaml_syntax_error_is_reported_at_its_mark_and_nothing_is_asked(client, fakeapi, tmp_path, created):
    path = write(tmp_path, TWO_GOOD + "---\nkind: task\nname: [unclosed\nimage: x\n")
    with pytest.raises(ValidationError) as caught:
        client.apply(path)
    error = caught.value
    assert error.file == path and error.line is not None and error.line >= 15
    assert error.column is not None and error.field is None
    assert created == [] and fakeapi.got("POST") == []
    assert fakeapi.got("GET", "/api/v1/schemas/jobs") == []  # refused before any request


def test_the_schema_is_cached_per_server_and_revalidated_by_etag(client, fakeapi, tmp_path, created):
    path = write(tmp_path, TWO_GOOD)
    client.apply(path)
    client.apply(path)
    asks = fakeapi.got("GET", "/api/v1/schemas/jobs")
    assert [a.headers.get("if-none-match") for a in asks] == [None, fakeapi.etag]
    assert jobfiles.cache_file(fakeapi.url).exists()
    assert len(created) == 4


def test_hf_apply_prints_every_problem_and_exits_1(hf, fakeapi, tmp_path, created):
    path = write(tmp_path, TWO_GOOD + "colour: red\n")
    code, out, err = hf("apply", "-f", path)
    assert code == 1
    assert f"{path}:13:1: colour: unknown field" in err
    assert "nothing was submitted" in err and "Traceback" not in err
    assert created == []
    code, out, err = hf("apply", "-f", write(tmp_path, "kind: task\nname: [x\n", "broken.yaml"))
    assert code == 1 and "broken.yaml:" in err and fakeapi.got("POST") == []


def test_hf_apply_creates_and_lists_what_it_made(hf, tmp_path, created):
    code, out, err = hf("apply", "-f", write(tmp_path, TWO_GOOD), "-o", "json")
    assert code == 0, err
    assert '"name": "hello"' in out and '"name": "train"' in out


def test_hf_run_checks_its_flags_against_the_schema_too(hf, created):
    code, out, err = hf("run", "--gpus", "0", "--", "echo", "hi")  # no --image
    assert code == 1 and "image: required field missing" in err and created == []
    code, out, err = hf("run", "--image", "busybox", "--gpus", "0", "--env", "A=1", "--", "echo", "hi")
    assert code == 0, err
    assert out.strip() == "1"
    assert created == [
        (
            "/api/v1/tasks",
            {"name": "echo", "image": "busybox", "gpu_required": 0, "command": ["echo", "hi"], "env": {"A": "1"}},
        )
    ]
