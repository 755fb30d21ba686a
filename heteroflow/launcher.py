"""`make up` and `make test`: bring the whole system up, or run the test suite, on a
fresh machine. Starts embedded PostgreSQL/Redis when no URLs are given.

    python -m heteroflow.launcher up            # web (ASGI), worker, beat, local agent
    python -m heteroflow.launcher test [-- ARGS] # the test suite (pytest ARGS)
    python -m heteroflow.launcher stores         # only the data stores, printing their URLs
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from heteroflow.embedded import ensure_data_stores
from heteroflow.envvars import Env
from heteroflow_agent.config import ENVIRONMENT_NAMES as AGENT_ENVIRONMENT_NAMES

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
STOP_GRACE_SECONDS = 15
WEB_READY_TIMEOUT = 60
PYTEST_NO_TESTS = 5
# `make test` runs the suite on this many pytest-xdist workers (HETEROFLOW_TEST_WORKERS),
# each with data stores of its own (tests/workers.py). Three on the 2-core machines: the
# end-to-end tests mostly wait on real processes, so a third worker overlaps them (the
# whole suite 9-10 min, against 13-15 on two); with four, their real deadlines (a node
# offline after N s, a rendezvous) were missed now and then under the CPU the others took.
DEFAULT_TEST_WORKERS = 3
XDIST_OPTIONS = ("-n", "--numprocesses", "--dist")


GRACEFUL_SHUTDOWN_SECONDS = 5


def web_command(host: str, port: int, *extra: str) -> list[str]:
    """How the web process is started, by `make up`, the benchmarks and the tests alike:
    uvicorn serving the ASGI application (the heartbeat's raw route in front of Django),
    with lifespan events (the gateway, the outermost app, answers them: at shutdown it
    writes the usage it gathered), without trust in proxy headers, and a bounded
    graceful shutdown (a log follower's stream never ends by itself: past it, open
    streams are cut and their clients reconnect elsewhere with Last-Event-ID); `extra`:
    more uvicorn options."""
    return [
        PYTHON,
        "-m",
        "uvicorn",
        "heteroflow.asgi:application",
        "--host",
        host,
        "--port",
        str(port),
        "--lifespan",
        "on",
        "--no-proxy-headers",
        "--timeout-graceful-shutdown",
        str(GRACEFUL_SHUTDOWN_SECONDS),
        *extra,
    ]


def say(message: str) -> None:
    print(f"[heteroflow] {message}", flush=True)


def data_dir_from(environ) -> Path:
    path = Path(Env(environ).str("HETEROFLOW_DATA_DIR", str(REPO / ".heteroflow"))).resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def private_file(path: Path, content: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(content)


def agent_secret(environ, data_dir: Path) -> str:
    """The agents' shared secret: from the environment, else one generated per data folder."""
    if environ.get("HETEROFLOW_AGENT_SECRET"):
        return environ["HETEROFLOW_AGENT_SECRET"]
    path = data_dir / "agent-secret"
    if not path.exists():
        private_file(path, secrets.token_urlsafe(32) + "\n")
    return path.read_text().strip()


def tunnel_command() -> list[str]:
    """The tunnel process (apps/tunnel/server.py): the agents dial it, the web processes
    splice users' sessions through it."""
    return [PYTHON, "manage.py", "tunnel"]


def local_agent_command(environ) -> list[str] | None:
    """The node agent of this machine (the agent/ package, installed editable). Set
    HETEROFLOW_LOCAL_AGENT=false to not start it."""
    if not Env(environ).bool("HETEROFLOW_LOCAL_AGENT", True):
        return None
    return [PYTHON, "-m", "heteroflow_agent"]


class Supervisor:
    def __init__(self, env: dict, log_dir: Path):
        self.env, self.log_dir = env, log_dir
        self.children: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict | None = None) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")
        self.children[name] = subprocess.Popen(
            argv, cwd=REPO, env=env or self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        say(f"started {name} (pid {self.children[name].pid}), log: {self.log_dir / f'{name}.log'}")

    def first_exited(self) -> tuple[str, int] | None:
        for name, child in self.children.items():
            if child.poll() is not None:
                return name, child.returncode
        return None

    def stop_all(self) -> None:
        for child in self.children.values():
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for name, child in self.children.items():
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{name} did not stop in {STOP_GRACE_SECONDS}s; killing it")
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()


def run_step(argv: list[str], env: dict, what: str) -> None:
    say(what)
    result = subprocess.run(argv, cwd=REPO, env=env)
    if result.returncode != 0:
        raise SystemExit(f"[heteroflow] failed: {what} (exit {result.returncode})")


def wait_for_web(url: str, child: subprocess.Popen) -> bool:
    deadline = time.monotonic() + WEB_READY_TIMEOUT
    while time.monotonic() < deadline:
        if child.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # it answered; /health may say 503 and that is still "up"
        except OSError:
            time.sleep(0.3)
    return False


def metrics_group_env(env: dict, data_dir: Path, group: str) -> dict:
    """An empty multiprocess metrics folder of the group's own (docs/monitoring.md)."""
    folder = data_dir / "metrics" / group
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return env | {"PROMETHEUS_MULTIPROC_DIR": str(folder)}


def base_env(stores, data_dir: Path) -> dict:
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # set per process group
    env.update(
        DATABASE_URL=stores.database_url,
        REDIS_URL=stores.redis_url,
        HETEROFLOW_DATA_DIR=str(data_dir),
        DJANGO_SETTINGS_MODULE="heteroflow.settings",
        PYTHONUNBUFFERED="1",
    )
    return env


def up(args) -> int:
    data_dir = data_dir_from(os.environ)
    log_dir = data_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    env_vars = Env()
    port = env_vars.int("HETEROFLOW_PORT", 3333, low=1, high=65535)
    bind = env_vars.str("HETEROFLOW_BIND", "127.0.0.1")
    stores = ensure_data_stores(data_dir, os.environ)
    say(
        "data stores: "
        + (
            ", ".join(stores.embedded) + f" embedded in {data_dir}"
            if stores.embedded
            else "external (from DATABASE_URL / REDIS_URL)"
        )
    )
    env = base_env(stores, data_dir)
    env["HETEROFLOW_AGENT_SECRET"] = agent_secret(os.environ, data_dir)
    if bind == "127.0.0.1" and "HETEROFLOW_APP_HOST" not in os.environ:
        # interactive tasks' apps on a host of their own: the browser keeps 127.0.0.1's
        # cookies (the portal's) from localhost's (docs/interactive.md#in-the-browser)
        env["HETEROFLOW_APP_HOST"] = f"localhost:{port}"
        say(f"interactive apps open on http://localhost:{port}/apps/<id>/ (the portal: http://127.0.0.1:{port}/)")
    supervisor = Supervisor(env, log_dir)
    stopping = {"signal": None}

    def on_signal(signum, frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    manage = [PYTHON, "manage.py"]
    try:
        run_step(
            manage + ["migrate_schemas", "--noinput", "-v", "1"],
            env,
            "applying migrations (public schema and every tenant schema)",
        )
        run_step(manage + ["bootstrap"], env, "bootstrapping the platform administrator")
        # what `curl …/api/v1/agent/install.sh | sudo bash` serves to new nodes; without it
        # (no network on a first start, say) only those endpoints answer 404
        if subprocess.run(manage + ["build_agent_dist"], cwd=REPO, env=env).returncode != 0:
            say("the agent installer has nothing to serve yet (see the message above); the rest starts anyway")
        supervisor.start(
            "web",
            web_command(bind, port),
            metrics_group_env(env, data_dir, "web"),
        )
        supervisor.start(
            "worker",
            [PYTHON, "-m", "celery", "-A", "celery_worker", "worker", "--loglevel", "INFO", "--concurrency", "2"],
            metrics_group_env(env, data_dir, "worker"),
        )
        supervisor.start(
            "beat",
            [
                PYTHON,
                "-m",
                "celery",
                "-A",
                "celery_worker",
                "beat",
                "--loglevel",
                "INFO",
                "--schedule",
                str(data_dir / "celerybeat-schedule"),
            ],
            metrics_group_env(env, data_dir, "beat"),
        )
        # the agents' outbound tunnels and the users' way into their tasks (docs/tunnel.md)
        supervisor.start("tunnel", tunnel_command(), env)
        agent = local_agent_command(os.environ)
        if agent:
            # the node agent of this machine: its node id is kept in the data folder
            # of the HETEROFLOW_* variables, only those the agent reads (it warns of others)
            agent_env = {
                name: value
                for name, value in env.items()
                if not name.startswith("HETEROFLOW_") or name in AGENT_ENVIRONMENT_NAMES
            } | {
                "HETEROFLOW_SERVER_URL": f"http://127.0.0.1:{port}",
                "HETEROFLOW_AGENT_DATA_DIR": str(data_dir / "agent"),
                "HETEROFLOW_AGENT_CONFIG": "-",  # never an installed agent's /etc/heteroflow-agent config
                # a newcomer's first task runs even without a container engine
                "HETEROFLOW_ALLOW_PROCESS_RUNTIME": os.environ.get("HETEROFLOW_ALLOW_PROCESS_RUNTIME", "true"),
                # ...as whoever ran `make up` on this machine, root included (an installed
                # node's agent refuses root unless its operator allows it: docs/agent.md)
                "HETEROFLOW_PROCESS_RUN_AS_ROOT": os.environ.get("HETEROFLOW_PROCESS_RUN_AS_ROOT", "true"),
            }
            supervisor.start("agent", agent, agent_env)
        else:
            say("local agent: not started (HETEROFLOW_LOCAL_AGENT=false)")
        host = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
        base = f"http://{host}:{port}"
        if not wait_for_web(f"{base}/health", supervisor.children["web"]):
            say(f"the web server did not come up; see {log_dir / 'web.log'}")
            return 1
        print(
            f"""
  HeteroFlow is up.
    portal        {base}/portal/
    admin         {base}/admin/
    API docs      {base}/api/docs/
    OpenAPI       {base}/api/schema/
    health        {base}/health
    metrics       {base}/metrics
  Logs in {log_dir}. Press Ctrl-C to stop.
""",
            flush=True,
        )
        while stopping["signal"] is None:
            exited = supervisor.first_exited()
            if exited:
                name, code = exited
                say(f"{name} exited with code {code}; stopping everything (see {log_dir / (name + '.log')})")
                return 1
            time.sleep(0.5)
        say("stopping")
        return 0
    finally:
        supervisor.stop_all()
        stores.stop()
        say("stopped")


def chose_workers(pytest_args: list[str]) -> bool:
    """Whether the caller's pytest arguments say how to distribute (-n 3, -n3, --dist=…,
    -p no:xdist)."""
    for arg in pytest_args:
        if arg in XDIST_OPTIONS or arg.startswith(tuple(option + "=" for option in XDIST_OPTIONS)):
            return True
        if (arg.startswith("-n") and arg[2:].isdigit()) or arg in ("no:xdist", "-pno:xdist"):
            return True
    return False


def with_workers(pytest_args: list[str], environ) -> list[str]:
    """The suite's arguments with its workers (`-n N --dist loadgroup`: a module's tests on
    one worker, tests/workers.py), unless the caller chose, or HETEROFLOW_TEST_WORKERS is
    0 or 1 (one process, as plain pytest)."""
    workers = Env(environ).int("HETEROFLOW_TEST_WORKERS", DEFAULT_TEST_WORKERS, low=0, high=64)
    if workers <= 1 or chose_workers(pytest_args):
        return pytest_args
    return ["-n", str(workers), "--dist", "loadgroup", *pytest_args]


def run_tests(args) -> int:
    data_dir = data_dir_from(os.environ) / "test"
    data_dir.mkdir(exist_ok=True)
    stores = ensure_data_stores(data_dir, os.environ)
    if stores.embedded:
        say(", ".join(stores.embedded) + f" embedded for the tests in {data_dir}")
    env = base_env(stores, data_dir) | {"HETEROFLOW_ENV": "test"}
    try:
        pytest_args = with_workers(args.pytest_args, os.environ)
        result = subprocess.run([PYTHON, "-m", "pytest", *pytest_args], cwd=REPO, env=env)
    finally:
        stores.stop()
    if result.returncode == PYTEST_NO_TESTS:
        say("pytest collected no tests: that is a failure, not a pass")
        return 1
    return result.returncode


def stores_only(args) -> int:
    data_dir = data_dir_from(os.environ)
    stores = ensure_data_stores(data_dir, os.environ)
    print(f"export DATABASE_URL='{stores.database_url}'\nexport REDIS_URL='{stores.redis_url}'", flush=True)
    say("data stores running; Ctrl-C to stop")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stores.stop()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="heteroflow.launcher")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the whole system")
    test = sub.add_parser("test", help="run the test suite")
    test.add_argument("pytest_args", nargs=argparse.REMAINDER)
    sub.add_parser("stores", help="start only the data stores")
    args = parser.parse_args(argv)
    if args.command == "test":
        args.pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    handler = {"up": up, "test": run_tests, "stores": stores_only}[args.command]
    try:
        return handler(args)
    except ImproperlyConfigured as exc:
        say(f"configuration error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
