"""Fixtures of the fault tests."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.live import REPO, server_env


@pytest.fixture
def own_postgres():
    """A PostgreSQL server of this test's own, with the control plane's database migrated
    and an operator key bootstrapped: (server, database URL, the key).

    Its data folder is not under tmp_path: run as root, pgserver runs the server as a user
    of its own and opens the folders above the data for it, and every pytest session that
    starts (another suite's, a worker's) closes /tmp/pytest-of-root to its owner again."""
    pgserver = pytest.importorskip("pgserver", reason="pgserver (requirements/base.txt) is not installed")
    folder = Path(tempfile.mkdtemp(prefix="heteroflow-pg-"))
    server = pgserver.get_server(folder / "pg", cleanup_mode="stop")
    server.psql("CREATE DATABASE heteroflow;")
    socket_dir = server.get_postmaster_info().socket_dir
    url = f"postgresql://postgres@{quote(str(socket_dir), safe='')}/heteroflow"  # as make up names it
    key = "sk-admin-" + secrets.token_hex(24)
    env = server_env(DATABASE_URL=url, HETEROFLOW_ADMIN_API_KEY=key, HETEROFLOW_ADMIN_PASSWORD="pw-" + key[-12:])
    for command in (["migrate_schemas", "--noinput", "-v", "0"], ["bootstrap"]):
        done = subprocess.run(
            [sys.executable, "manage.py", *command], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stdout + done.stderr
    yield server, socket_dir, url, key
    server.cleanup()
    shutil.rmtree(folder, ignore_errors=True)
