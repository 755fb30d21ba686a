"""The node agent's own footprint: the real `heteroflow-agent` process beating every
interval to a stand-in control plane, with a stand-in `nvidia-smi` that reports eight
A100s (the recorded outputs of agent/tests/fixtures/nvidia) and the executor polling
an empty task channel (process runtime), for N minutes. Samples
the agent's resident memory and CPU time (its own, not the tool's children) and prints
them. Target: under 60 MB RSS and under 1 % of one core at 5 s with 8 GPUs.

    make bench-agent                      (10 minutes)
    .venv/bin/python bench/agent_resources.py --minutes 2

Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "agent" / "tests" / "fixtures" / "nvidia"

STAND_IN = """#!/bin/sh
# nvidia-smi, as eight A100s answer it
case "$*" in
  *--query-gpu*) cat "{fixtures}/query_8x_a100.csv" ;;
  *topo*) cat "{fixtures}/topo_8x_nvswitch.txt" ;;
  *-q*) cat "{fixtures}/q_8x_a100.txt" ;;
  *) echo "stand-in nvidia-smi: unexpected arguments: $*" >&2; exit 64 ;;
esac
"""


class ControlPlane:
    """Accepts every heartbeat (200) and counts them."""

    def __init__(self):
        self.beats = 0
        self.polls = 0
        self.gpus_seen = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                owner.beats += 1
                owner.gpus_seen = len(body.get("gpu_stats", []))
                data = json.dumps({"status": "online", "registered": owner.beats == 1, "scheduled_tasks": []}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # the task channel: nothing scheduled here
                owner.polls += 1
                data = b'{"results": []}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=int, default=5)
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="hf-bench-agent-"))
    bin_dir = scratch / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text(STAND_IN.format(fixtures=FIXTURES))
    tool.chmod(0o755)
    (scratch / "models").mkdir()
    plane = ControlPlane()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")} | {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HETEROFLOW_SERVER_URL": plane.url,
        "HETEROFLOW_AGENT_KEY": "bench-key-" + "x" * 16,
        "HETEROFLOW_AGENT_DATA_DIR": str(scratch / "data"),
        "HETEROFLOW_HEARTBEAT_INTERVAL": str(args.interval),
        "HETEROFLOW_MODEL_SCAN_DIRS": str(scratch / "models"),
        "HETEROFLOW_AGENT_LOG_LEVEL": "warning",
        # a node that runs tasks: the executor polls its task channel every 5 s too
        "HETEROFLOW_ALLOW_PROCESS_RUNTIME": "true",
        "HETEROFLOW_PROCESS_RUN_AS_ROOT": "true",  # where the bench runs as root: its tasks are its own
    }
    agent = subprocess.Popen([sys.executable, "-m", "heteroflow_agent"], cwd=scratch, env=env, start_new_session=True)
    process = psutil.Process(agent.pid)
    print(
        f"agent pid {agent.pid}: 8 stand-in A100s, a beat every {args.interval} s, for {args.minutes:g} min; "
        f"machine: {os.cpu_count()} cores",
        flush=True,
    )
    samples: list[tuple[float, float, float]] = []  # (wall, cpu seconds, rss bytes)
    try:
        started = time.monotonic()
        end = started + args.minutes * 60
        while time.monotonic() < end and agent.poll() is None:
            times = process.cpu_times()
            samples.append((time.monotonic(), times.user + times.system, process.memory_info().rss))
            time.sleep(min(5.0, max(0.1, end - time.monotonic())))
        if agent.poll() is not None:
            print(f"the agent exited early with code {agent.returncode}")
            return 1
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
            agent.wait(timeout=30)
        plane.httpd.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)

    warm = [s for s in samples if s[0] - samples[0][0] >= 30] or samples  # after start-up (imports, first probes)
    wall = warm[-1][0] - warm[0][0]
    cpu = warm[-1][1] - warm[0][1]
    rss = sorted(s[2] for s in samples)
    print(f"  heartbeats received   {plane.beats} (last one listed {plane.gpus_seen} GPUs); task polls {plane.polls}")
    print(f"  resident memory       p50 {rss[len(rss) // 2] / 2**20:.1f} MB, max {rss[-1] / 2**20:.1f} MB")
    print(
        f"  CPU                   {100 * cpu / wall if wall else float('nan'):.2f} % of one core "
        f"({cpu:.2f} s over {wall:.0f} s after the first 30 s)"
    )
    print(f"  CPU incl. start-up    {100 * samples[-1][1] / (samples[-1][0] - samples[0][0] + 1e-9):.2f} % of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
