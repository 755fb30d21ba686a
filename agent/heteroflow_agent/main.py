"""`heteroflow-agent`: load the configuration, then beat every interval until told to
stop (SIGTERM / SIGINT). The agent listens on no port: every exchange is a call it makes.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

from heteroflow_agent import config as agent_config
from heteroflow_agent.client import ServerClient
from heteroflow_agent.heartbeat import Heartbeat
from heteroflow_agent.version import current

logger = logging.getLogger("heteroflow_agent")


def build_heartbeat(cfg: agent_config.AgentConfig) -> Heartbeat:
    from heteroflow_agent.detect import Detector

    version = current()
    client = ServerClient(
        cfg.server_url, cfg.api_key, connect_timeout=cfg.connect_timeout, read_timeout=cfg.read_timeout,
        user_agent=f"heteroflow-agent/{version.version}",
    )
    detector = Detector(timeout=cfg.tool_timeout)
    return Heartbeat(cfg, client, detect_gpus=detector.detect, version=version)


def run(heartbeat: Heartbeat, stop: threading.Event, clock=time.monotonic) -> int:
    """Beat on a fixed schedule. A beat that overran the interval does not make the next
    ones come faster to catch up: missed slots are skipped."""
    interval = heartbeat.config.heartbeat_interval
    due = clock()
    while not stop.is_set():
        heartbeat.beat()
        due += interval
        now = clock()
        if due <= now:
            due = now + interval
        stop.wait(due - now)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heteroflow-agent", description=__doc__)
    parser.add_argument("--config", help=f"configuration file (default: $HETEROFLOW_AGENT_CONFIG or {agent_config.DEFAULT_CONFIG_FILE})")
    parser.add_argument("--once", action="store_true", help="send one heartbeat and exit (0 if it was accepted)")
    parser.add_argument("--print-payload", action="store_true", help="print the heartbeat this node would send, send nothing")
    parser.add_argument("--version", action="store_true", help="print the version triple and exit")
    args = parser.parse_args(argv)

    if args.version:
        version = current()
        print(f"heteroflow-agent {version.version} (commit {version.git_commit}, built {version.build_time})")
        return 0
    try:
        cfg = agent_config.load(args.config)
    except agent_config.ConfigError as exc:
        print("heteroflow-agent: configuration problems:\n  - " + "\n  - ".join(exc.problems), file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    heartbeat = build_heartbeat(cfg)
    if args.print_payload:
        print(json.dumps(heartbeat.payload(), indent=2, sort_keys=True))
        return 0
    if args.once:
        return 0 if heartbeat.beat() is not None else 1

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    version = heartbeat.version
    logger.info(
        "heteroflow-agent %s (%s, %s) starting: node %s, server %s, every %d s",
        version.version, version.git_commit, version.build_time, cfg.node_id, cfg.server_url, cfg.heartbeat_interval,
    )
    if version.dirty:
        logger.warning("this agent was built from a tree with uncommitted changes (%s)", version.git_commit)
    try:
        return run(heartbeat, stop)
    finally:
        heartbeat.client.close()
        logger.info("heteroflow-agent stopped")


if __name__ == "__main__":
    sys.exit(main())
