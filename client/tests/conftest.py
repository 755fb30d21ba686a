"""Fixtures of the client's tests: a home of their own (config and cache folders, no
HETEROFLOW_* variables from the caller), a stand-in API (hf_fakeapi.FakeAPI), and `hf`
run in-process through Click's runner."""

from __future__ import annotations

import sys
from pathlib import Path

# the package from this tree, installed (`make install`: pip install -e ./client) or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from hf_fakeapi import KEY, FakeAPI  # noqa: E402

from heteroflow_client.cli import cli  # noqa: E402


@pytest.fixture
def home(tmp_path, monkeypatch):
    for name in ("HETEROFLOW_URL", "HETEROFLOW_API_KEY", "HETEROFLOW_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def fakeapi():
    api = FakeAPI()
    yield api
    api.close()


@pytest.fixture
def hf(home, fakeapi, monkeypatch):
    """Run `hf ARGS…` against the stand-in API with its key; (exit code, stdout, stderr)."""
    monkeypatch.setenv("HETEROFLOW_URL", fakeapi.url)
    monkeypatch.setenv("HETEROFLOW_API_KEY", KEY)

    def run(*args, input=None):
        result = CliRunner().invoke(cli, list(args), input=input, prog_name="hf", catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    return run
