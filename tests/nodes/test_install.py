"""Agent installation from the control plane: the scripts run for real with bash against
Django's live server, in a scratch root (`--root`), never on this machine's / .

The full install builds a real dist for this machine's architecture only. Its dependency
wheels are kept in a wheelhouse under the system temp folder, keyed by the agent's
requirements, so only the first run on a machine downloads anything. When PyPI cannot be
reached and that wheelhouse is empty, only the tests that need real wheels are skipped.

No `world` here: the live server needs `transactional_db`, and `world` holds a
transaction for the whole module.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import zipfile
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from apps.nodes import distribution

HOST_ARCH = distribution.normalize_arch(platform.machine())
OTHER_ARCH = "aarch64" if HOST_ARCH == "x86_64" else "x86_64"
REPO = Path(settings.BASE_DIR)
PATHS = distribution.AGENT_PATH
KEY_MISMATCH = "the key does not match this control plane; the agent would never come online"

pytestmark = pytest.mark.skipif(HOST_ARCH is None, reason=f"no agent build exists for {platform.machine()}")


# --- helpers ------------------------------------------------------------------------------


def wheelhouse_cache() -> Path:
    """A wheelhouse shared by test runs on this machine, keyed by what decides its content."""
    project = distribution.read_project(REPO / "agent")
    key = json.dumps(
        [
            project["dependencies"],
            project["build_requires"],
            distribution.SERVED_PYTHONS,
            distribution.platform_tags(HOST_ARCH),
        ]
    )
    return Path(tempfile.gettempdir()) / f"heteroflow-test-wheelhouse-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def run_script(url: str, name: str, *args: str, tmp: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`curl -fsSL URL/<name> | bash -s -- ARGS`, the way a node runs it. Outbound HTTP
    other than to the live server goes to a dead proxy, so nothing can quietly use PyPI."""
    scratch = tmp / "tmpdir"
    scratch.mkdir(exist_ok=True)
    environment = (
        os.environ
        | {
            "TMPDIR": str(scratch),
            "http_proxy": "http://127.0.0.1:9",
            "https_proxy": "http://127.0.0.1:9",
            "HTTP_PROXY": "http://127.0.0.1:9",
            "HTTPS_PROXY": "http://127.0.0.1:9",
            "no_proxy": "localhost,127.0.0.1",
            "NO_PROXY": "localhost,127.0.0.1",
        }
        | (env or {})
    )
    quoted = " ".join("'" + a.replace("'", "'\\''") + "'" for a in args)
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"curl -fsSL '{url}{PATHS}/{name}' | bash -s -- {quoted}"],
        capture_output=True,
        text=True,
        env=environment,
        stdin=subprocess.DEVNULL,
        timeout=240,
    )


def fake_wheel(directory: Path, name: str, payload: bytes = b"") -> Path:
    path = directory / name
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("README", b"not a real wheel " + payload)
    return path


@pytest.fixture
def fake_dist(tmp_path, settings):
    """A published set of stand-in files for this machine's architecture (enough for
    everything that happens before pip runs)."""
    source = tmp_path / "files"
    source.mkdir()
    files = [
        fake_wheel(source, "heteroflow_agent-0.1.0-py3-none-any.whl", b"agent"),
        fake_wheel(source, "pip-26.0-py3-none-any.whl", b"pip"),
        fake_wheel(source, "psutil-7.2.2-cp36-abi3-manylinux2014_x86_64.whl", b"psutil"),
    ]
    root = tmp_path / "dist"
    manifest = {
        "arch": HOST_ARCH,
        "agent": {"version": "0.1.0", "git_commit": "abc1234", "build_time": "2026-01-01T00:00:00Z"},
    }
    build, changed = distribution.publish(HOST_ARCH, files, manifest, root)
    assert changed
    settings.HETEROFLOW_AGENT_DIST_DIR = root
    return build


@pytest.fixture(scope="module")
def real_dist(tmp_path_factory):
    """A real dist for this machine's architecture, built by the management command."""
    root = tmp_path_factory.mktemp("agent-dist")
    wheelhouse = wheelhouse_cache()
    tree_stamp = REPO / "agent" / distribution.AGENT_PACKAGE / distribution.BUILD_INFO_NAME
    stamp_before = tree_stamp.read_bytes() if tree_stamp.exists() else None
    try:
        call_command("build_agent_dist", "--arch", HOST_ARCH, "--dist-dir", str(root), "--wheelhouse", str(wheelhouse))
    except CommandError as exc:
        if "could not be reached" in str(exc):
            pytest.skip(
                f"PyPI cannot be reached and {wheelhouse} lacks the wheels, so no real dist can be built: {exc}"
            )
        raise
    stamp_after = tree_stamp.read_bytes() if tree_stamp.exists() else None
    assert stamp_after == stamp_before, "the build left a stamp in the source tree"
    return root


# --- the scripts --------------------------------------------------------------------------


@pytest.mark.parametrize("name", distribution.SCRIPTS)
def test_scripts_embed_the_url_they_were_fetched_from(client, name, tmp_path):
    response = client.get(f"{PATHS}/{name}", HTTP_HOST="hf.example.net:3333")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/x-shellscript")
    text = response.content.decode()
    assert "HF_SERVER_URL='http://hf.example.net:3333'" in text
    assert "@@" not in text
    script = tmp_path / name
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_scripts_embed_the_configured_public_url(client, settings):
    settings.HETEROFLOW_PUBLIC_URL = "https://hf.example.com"
    text = client.get(f"{PATHS}/install.sh", HTTP_HOST="10.0.0.5:3333").content.decode()
    assert "HF_SERVER_URL='https://hf.example.com'" in text
    assert "10.0.0.5" not in text


def test_script_help_runs(client, tmp_path):
    script = tmp_path / "install.sh"
    script.write_text(client.get(f"{PATHS}/install.sh").content.decode())
    result = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for option in ("--key", "--server", "--node-id", "--interval", "--arch", "--root", "--no-start"):
        assert option in result.stdout


# --- the dist endpoints -------------------------------------------------------------------


def test_an_unbuilt_architecture_answers_404_with_instructions(client, settings, tmp_path):
    settings.HETEROFLOW_AGENT_DIST_DIR = tmp_path / "empty"
    for path in (
        f"dist/{OTHER_ARCH}/",
        f"dist/{OTHER_ARCH}/SHA256SUMS",
        f"dist/{OTHER_ARCH}/pip-26.0-py3-none-any.whl",
    ):
        response = client.get(f"{PATHS}/{path}")
        assert response.status_code == 404, path
        error = response.json()["error"]
        assert error["code"] == "no_agent_build"
        assert f"manage.py build_agent_dist --arch {OTHER_ARCH}" in error["message"]
        assert error["fields"]["arch"]


def test_one_architectures_build_is_never_served_for_another(client, fake_dist):
    assert client.get(f"{PATHS}/dist/{HOST_ARCH}/SHA256SUMS").status_code == 200
    response = client.get(f"{PATHS}/dist/{OTHER_ARCH}/SHA256SUMS")
    assert response.status_code == 404 and response.json()["error"]["code"] == "no_agent_build"
    alias = {"x86_64": "amd64", "aarch64": "arm64"}[HOST_ARCH]
    assert (
        client.get(f"{PATHS}/dist/{alias}/SHA256SUMS").content
        == client.get(f"{PATHS}/dist/{HOST_ARCH}/SHA256SUMS").content
    )


def test_an_unknown_architecture_answers_404_naming_the_supported_ones(client, fake_dist):
    response = client.get(f"{PATHS}/dist/riscv64/SHA256SUMS")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "unsupported_arch"
    assert "x86_64" in error["message"] and "aarch64" in error["message"]


def test_sha256sums_lists_every_served_file_with_its_checksum(client, fake_dist):
    response = client.get(f"{PATHS}/dist/{HOST_ARCH}/SHA256SUMS")
    assert response.status_code == 200
    listed = distribution.parse_sums(response.content.decode())
    on_disk = {p.name for p in fake_dist.directory.iterdir()} - {distribution.SUMS_NAME}
    assert set(listed) == on_disk
    for name, digest in listed.items():
        served = client.get(f"{PATHS}/dist/{HOST_ARCH}/{name}")
        assert served.status_code == 200
        assert (
            hashlib.sha256(served.content).hexdigest()
            == digest
            == hashlib.sha256((fake_dist.directory / name).read_bytes()).hexdigest()
        )
    index = client.get(f"{PATHS}/dist/{HOST_ARCH}/").json()
    assert {f["name"]: f["sha256"] for f in index["files"]} == listed
    assert index["agent"]["git_commit"] == "abc1234"


def test_only_listed_files_are_served(client, fake_dist):
    (fake_dist.directory / "stray.whl").write_bytes(b"not listed")
    for name in ("stray.whl", "..%2F..%2Fmanifest.json", "nothing.whl"):
        assert client.get(f"{PATHS}/dist/{HOST_ARCH}/{name}").status_code == 404, name


def test_republishing_the_same_files_changes_nothing_and_a_change_swaps_the_set(tmp_path):
    source = tmp_path / "files"
    source.mkdir()
    first = [fake_wheel(source, "heteroflow_agent-0.1.0-py3-none-any.whl", b"1")]
    build, changed = distribution.publish(HOST_ARCH, first, {"n": 1}, tmp_path / "dist")
    again, changed_again = distribution.publish(HOST_ARCH, first, {"n": 1}, tmp_path / "dist")
    assert changed and not changed_again and again.directory == build.directory
    second = [fake_wheel(source, "heteroflow_agent-0.1.0-py3-none-any.whl", b"2")]
    newer, changed = distribution.publish(HOST_ARCH, second, {"n": 2}, tmp_path / "dist")
    assert changed and newer.directory != build.directory
    assert (tmp_path / "dist" / HOST_ARCH).resolve() == newer.directory


# --- the scripts against a live server ------------------------------------------------------


def test_a_wrong_key_stops_the_installer_before_it_writes_anything(live_server, tmp_path, settings):
    settings.HETEROFLOW_AGENT_DIST_DIR = tmp_path / "no-dist-needed"
    root = tmp_path / "root"
    root.mkdir()
    result = run_script(
        live_server.url, "install.sh", "--key", "not-the-agent-secret", "--root", str(root), tmp=tmp_path
    )
    assert result.returncode != 0
    assert KEY_MISMATCH in result.stderr
    assert tree(root) == []
    assert tree(tmp_path / "tmpdir") == []  # its download folder is gone too


def test_a_tampered_file_stops_the_installer(live_server, tmp_path, fake_dist):
    victim = fake_dist.directory / "psutil-7.2.2-cp36-abi3-manylinux2014_x86_64.whl"
    victim.write_bytes(victim.read_bytes() + b"tampered")
    root = tmp_path / "root"
    root.mkdir()
    key = settings.HETEROFLOW_AGENT_SECRET
    result = run_script(
        live_server.url, "install.sh", "--key", key, "--root", str(root), "--arch", HOST_ARCH, tmp=tmp_path
    )
    assert result.returncode != 0
    assert "checksum mismatch" in result.stderr and victim.name in result.stderr
    assert "key accepted" in result.stdout
    assert tree(root) == []


def test_an_unbuilt_architecture_stops_the_installer_with_the_servers_instructions(live_server, tmp_path, fake_dist):
    root = tmp_path / "root"
    root.mkdir()
    key = settings.HETEROFLOW_AGENT_SECRET
    result = run_script(
        live_server.url, "install.sh", "--key", key, "--root", str(root), "--arch", OTHER_ARCH, tmp=tmp_path
    )
    assert result.returncode != 0
    assert f"build_agent_dist --arch {OTHER_ARCH}" in result.stderr
    assert tree(root) == []


def test_full_install_then_quick_and_force_updates(live_server, tmp_path, real_dist, settings):
    settings.HETEROFLOW_AGENT_DIST_DIR = real_dist
    root = tmp_path / "root"
    root.mkdir()
    key = settings.HETEROFLOW_AGENT_SECRET
    result = run_script(
        live_server.url,
        "install.sh",
        "--key",
        key,
        "--root",
        str(root),
        "--node-id",
        "gpu-node-1",
        "--interval",
        "10",
        tmp=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "downloaded and verified" in result.stdout

    config_path = root / "etc/heteroflow-agent/agent-config.json"
    assert stat.S_IMODE(config_path.stat().st_mode) == 0o600
    config = json.loads(config_path.read_text())
    assert config == {
        "server_url": live_server.url,
        "api_key": key,
        "heartbeat_interval": 10,
        "node_id": "gpu-node-1",
        "data_dir": f"{root}/var/lib/heteroflow-agent",
    }

    venv = root / "opt/heteroflow-agent/venv"
    unit = (root / "etc/systemd/system/heteroflow-agent.service").read_text()
    path_line = next(line for line in unit.splitlines() if line.startswith("Environment=PATH="))
    assert "/usr/lib/wsl/lib" in path_line.split("=", 2)[2].split(":")
    assert f"ExecStart={venv}/bin/heteroflow-agent" in unit.splitlines()
    assert "Restart=always" in unit.splitlines()
    assert "KillMode=process" in unit.splitlines()  # tasks outlive an agent restart
    assert f"Environment=HETEROFLOW_AGENT_CONFIG={config_path}" in unit.splitlines()
    assert "WantedBy=multi-user.target" in unit

    # The agent and its pinned dependencies are in the venv, stamped by the build.
    python = venv / "bin/python"
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import json, requests, psutil, pynvml, docker; from heteroflow_agent import version; "
            "v = version.current(); "
            "print(json.dumps([v.version, v.git_commit, v.build_time, requests.__version__, psutil.__version__]))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    agent_version, commit, build_time, requests_version, psutil_version = json.loads(probe.stdout)
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert agent_version == distribution.read_project(REPO / "agent")["version"]
    assert commit.removesuffix("-dirty") == head
    assert build_time.endswith("Z") and build_time != "unknown"
    assert (requests_version, psutil_version) == ("2.34.2", "7.2.2")
    assert os.access(venv / "bin/heteroflow-agent", os.X_OK)
    first_venv = venv.resolve()

    # Quick update: same virtual environment, agent reinstalled, configuration untouched.
    config_bytes = config_path.read_bytes()
    result = run_script(live_server.url, "update-agent-quick.sh", "--root", str(root), tmp=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "configuration kept" in result.stdout
    assert venv.resolve() == first_venv
    assert config_path.read_bytes() == config_bytes

    # Force update: a fresh virtual environment, the old one wiped, configuration untouched.
    result = run_script(live_server.url, "update-agent-force.sh", "--root", str(root), tmp=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert venv.resolve() != first_venv and not first_venv.exists()
    assert [p.name for p in (root / "opt/heteroflow-agent/venvs").iterdir()] == [venv.resolve().name]
    assert config_path.read_bytes() == config_bytes
    subprocess.run([str(python), "-c", "import heteroflow_agent, docker"], check=True)
    assert tree(tmp_path / "tmpdir") == []

    # A rebuild needs no network now: everything comes from the wheelhouse.
    out = io.StringIO()
    call_command(
        "build_agent_dist",
        "--arch",
        HOST_ARCH,
        "--dist-dir",
        str(real_dist),
        "--wheelhouse",
        str(wheelhouse_cache()),
        "--offline",
        stdout=out,
    )
    assert "taken from" in out.getvalue() and "downloading" not in out.getvalue()


def test_offline_build_names_every_missing_wheel(tmp_path):
    """No network needed: the agent wheel of a frozen copy of the sources is already in
    the dist's cache, the wheelhouse is empty, so every pin is reported missing."""
    source = tmp_path / "agent-src"
    shutil.copytree(
        REPO / "agent", source, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "tests", "build")
    )
    cached = tmp_path / "dist" / "agent" / distribution.agent_build_key(source)
    cached.mkdir(parents=True)
    fake_wheel(cached, "heteroflow_agent-0.1.0-py3-none-any.whl")
    (cached / distribution.BUILD_INFO_NAME).write_text(
        json.dumps({"version": "0.1.0", "git_commit": "unknown", "build_time": "x"})
    )
    with pytest.raises(CommandError) as caught:
        call_command(
            "build_agent_dist",
            "--arch",
            HOST_ARCH,
            "--dist-dir",
            str(tmp_path / "dist"),
            "--wheelhouse",
            str(tmp_path / "empty"),
            "--source",
            str(source),
            "--offline",
            stdout=io.StringIO(),
        )
    message = str(caught.value)
    for pin in distribution.read_project(source)["dependencies"] + ["pip"]:
        assert pin in message
    assert "--offline" in message and HOST_ARCH in message
    assert not (tmp_path / "dist" / HOST_ARCH).exists()


def test_offline_build_without_build_tools_says_so(tmp_path):
    with pytest.raises(CommandError) as caught:
        call_command(
            "build_agent_dist",
            "--arch",
            HOST_ARCH,
            "--dist-dir",
            str(tmp_path / "dist"),
            "--wheelhouse",
            str(tmp_path / "empty"),
            "--offline",
            stdout=io.StringIO(),
        )
    assert "build tools" in str(caught.value) and "setuptools" in str(caught.value)
