import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from heteroflow.safety import DEV_AGENT_SECRET, production_problems

REPO = Path(__file__).resolve().parents[2]
GOOD = {
    "secret_key": secrets.token_urlsafe(50),
    "debug": False,
    "allowed_hosts": ["hf.example.com"],
    "agent_secret": secrets.token_urlsafe(24),
}


def test_safe_values_have_no_problems():
    assert production_problems(**GOOD) == []


@pytest.mark.parametrize(
    "change,problem",
    [
        ({"agent_secret": None}, "HETEROFLOW_AGENT_SECRET is not set"),
        ({"agent_secret": "changeme"}, "HETEROFLOW_AGENT_SECRET is a well-known default value"),
        ({"agent_secret": DEV_AGENT_SECRET}, "HETEROFLOW_AGENT_SECRET is a well-known default value"),
        ({"agent_secret": "short-secret"}, "HETEROFLOW_AGENT_SECRET is shorter than 16 characters"),
        ({"secret_key": None}, "SECRET_KEY is not set"),
        ({"secret_key": "django-insecure-abc"}, "SECRET_KEY is a well-known default value"),
        ({"secret_key": "ChangeMe"}, "SECRET_KEY is a well-known default value"),
        ({"secret_key": "x" * 49}, "SECRET_KEY is shorter than 50 characters"),
        ({"debug": True}, "DEBUG is on"),
        ({"allowed_hosts": ["*"]}, "ALLOWED_HOSTS contains a wildcard ('*')"),
        ({"allowed_hosts": ["ok.example.com", "*.example.com"]}, "ALLOWED_HOSTS contains a wildcard ('*')"),
        ({"allowed_hosts": []}, "ALLOWED_HOSTS is empty"),
    ],
)
def test_each_unsafe_value_is_named(change, problem):
    assert production_problems(**(GOOD | change)) == [problem]


def manage(args, **env_changes):
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SECRET_KEY", "DEBUG", "ALLOWED_HOSTS", "HETEROFLOW_"))
    }
    env.update(
        HETEROFLOW_ENV="production",
        SECRET_KEY=GOOD["secret_key"],
        HETEROFLOW_AGENT_SECRET=GOOD["agent_secret"],
        ALLOWED_HOSTS="hf.example.com",
    )
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_check_deploy_passes_with_production_settings():
    result = manage(["check", "--deploy", "--fail-level", "WARNING"])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "env,message",
    [
        ({"HETEROFLOW_AGENT_SECRET": None}, "HETEROFLOW_AGENT_SECRET is not set"),
        (
            {"HETEROFLOW_AGENT_SECRET": "heteroflow-agent-secret"},
            "HETEROFLOW_AGENT_SECRET is a well-known default value",
        ),
        (
            {"SECRET_KEY": None, "DEBUG": "true", "ALLOWED_HOSTS": "*"},
            "SECRET_KEY is not set; DEBUG is on; ALLOWED_HOSTS contains a wildcard",
        ),
    ],
)
def test_production_mode_refuses_to_start_with_unsafe_values(env, message):
    result = manage(["check"], **env)
    assert result.returncode != 0
    assert "refuses to start in production mode" in result.stderr
    assert message in result.stderr


def test_bad_numbers_are_refused_with_the_variable_named():
    result = manage(["check"], HETEROFLOW_PORT="70000")
    assert result.returncode != 0
    assert "HETEROFLOW_PORT=70000 is outside 1..65535" in result.stderr


def test_the_launcher_refuses_a_bad_port_with_a_message():
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")} | {"HETEROFLOW_PORT": "http"}
    result = subprocess.run(
        [sys.executable, "-m", "heteroflow.launcher", "up"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "HETEROFLOW_PORT='http' is not a whole number" in result.stdout
