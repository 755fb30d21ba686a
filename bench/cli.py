"""The command line's own times (docs/cli.md#speed): how long `hf --version` takes to
start, and how long `hf ps -o json` takes end to end against a live control plane whose
tenant has 10,000 tasks.

    make bench-cli
    .venv/bin/python bench/cli.py --tasks 10000 --active 2000 --runs 20

The server runs as `make up` runs it (uvicorn, one process, production settings). The
tasks are written through the ORM in bulk (apps.tasks.services.create_tasks, then most of
them marked completed), not through the API. `hf` is the one `make install` put in the
virtual environment (pip install -e ./client). Uses DATABASE_URL / REDIS_URL when set,
else the embedded pair in a scratch folder; works in a database of its own,
heteroflow_bench_cli, dropped before and after. Prints the medians and, for each target,
PASS or FAIL (the exit status stays 0: on a shared machine a figure is a measurement).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.heartbeats import server_env, start_server, stores_in_use, with_database  # noqa: E402
from heteroflow.embedded import ensure_data_stores  # noqa: E402

DB_NAME = "heteroflow_bench_cli"
TENANT = "bench"
VERSION_TARGET_MS = 150
PS_TARGET_MS = 400

SETUP = r"""
import sys, django
django.setup()
from django.utils import timezone
from apps.core.principals import Principal, PrincipalKind
from apps.tasks.models import Task
from apps.tasks.services import create_tasks
from apps.tenants.choices import Role
from apps.tenants.services import add_member, create_tenant, issue_tenant_key
from django.contrib.auth import get_user_model

slug, total, active = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tenant = create_tenant(name="Bench", slug=slug)
spec = {"name": "sweep", "image": "registry.local/sweep:1", "command": ["python", "run.py"], "gpu_required": 1}
for start in range(0, total, 1000):
    create_tasks(tenant, [spec] * min(1000, total - start))
finished = Task.objects.filter(tenant=tenant).order_by("id").values_list("id", flat=True)[: total - active]
Task.objects.filter(id__in=list(finished)).update(status="completed", exit_code=0, finished_at=timezone.now())
user = get_user_model().objects.create_user("bench", "bench@example.test", "x")
add_member(tenant, username=user.username, role=Role.MEMBER)
owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role=Role.MEMBER)
print(issue_tenant_key(principal=owner, tenant=tenant, owner=user, name="bench").key)
"""


def say(message: str) -> None:
    print(message, flush=True)


def timed(command: list[str], env: dict, runs: int) -> tuple[list[float], str]:
    """Wall-clock milliseconds of each run of `command`, and the last run's output."""
    times, out = [], ""
    for _ in range(runs):
        began = time.perf_counter()
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        times.append((time.perf_counter() - began) * 1000)
        if result.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        out = result.stdout
    return times, out


def verdict(what: str, value: float, target: float) -> str:
    return f"  {'PASS' if value <= target else 'FAIL'}  {what}: {value:.0f} ms (<= {target} ms)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks in the tenant")
    parser.add_argument("--active", type=int, default=2_000, help="of which still active (pending)")
    parser.add_argument("--runs", type=int, default=20, help="runs of each command (the median is shown)")
    parser.add_argument("--hf", default=str(Path(sys.executable).with_name("hf")), help="the hf to time")
    args = parser.parse_args()
    if not Path(args.hf).exists():
        raise SystemExit(f"{args.hf} is missing: make install (pip install -e ./client)")

    scratch = Path(tempfile.mkdtemp(prefix="hf-bench-cli-"))
    (scratch / "static").mkdir()
    stores = ensure_data_stores(scratch, os.environ)
    admin_url = stores.database_url
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB_NAME}")
    database_url = with_database(admin_url, DB_NAME)
    env = server_env(database_url, stores.redis_url, scratch, "bench-agent-secret-not-used")
    server = None
    try:
        subprocess.run(
            [sys.executable, "manage.py", "migrate_schemas", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True
        )
        began = time.perf_counter()
        key = (
            subprocess.run(
                [sys.executable, "-c", SETUP, TENANT, str(args.tasks), str(args.active)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        say(f"{args.tasks:,} tasks written in {time.perf_counter() - began:.1f} s ({args.active:,} active)")
        server, port = start_server(env, 1)
        say(
            f"server: uvicorn, 1 process, production settings; data stores: {stores_in_use(stores)}; "
            f"machine: {os.cpu_count()} cores; hf: {args.hf}"
        )
        hf_env = {k: v for k, v in os.environ.items() if not k.startswith(("HETEROFLOW_", "DJANGO_"))} | {
            "HETEROFLOW_URL": f"http://127.0.0.1:{port}",
            "HETEROFLOW_API_KEY": key,
            "XDG_CONFIG_HOME": str(scratch / "config"),
            "XDG_CACHE_HOME": str(scratch / "cache"),
        }

        version, _ = timed([args.hf, "--version"], hf_env, args.runs)
        timed([args.hf, "ps", "-o", "json"], hf_env, 2)  # warm-up: the server's first requests
        ps, out = timed([args.hf, "ps", "-o", "json"], hf_env, args.runs)
        shown = out.count('"id":')
        everything, out_all = timed([args.hf, "ps", "--all", "-o", "json"], hf_env, args.runs)
        table, _ = timed([args.hf, "ps"], hf_env, args.runs)

        debug = subprocess.run([args.hf, "--debug", "ps", "-o", "json"], env=hf_env, capture_output=True, text=True)
        say("\n== the requests of one hf ps (--debug) ==")
        for line in debug.stderr.splitlines():
            say(f"  {line}")
        say(f"\n== hf, median of {args.runs} runs (min-max) ==")
        for label, times in (
            ("hf --version", version),
            (f"hf ps -o json ({shown} shown)", ps),
            (f"hf ps --all -o json ({out_all.count(chr(34) + 'id' + chr(34) + ':')} shown)", everything),
            ("hf ps (table)", table),
        ):
            say(f"  {label:<34} {statistics.median(times):6.0f} ms ({min(times):.0f}-{max(times):.0f})")
        say("")
        say(verdict("hf --version", statistics.median(version), VERSION_TARGET_MS))
        say(verdict("hf ps -o json", statistics.median(ps), PS_TARGET_MS))
        return 0
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        stores.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
