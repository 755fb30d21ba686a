"""`heteroflow-agent`: load the configuration, then beat every interval until told to
stop (SIGTERM / SIGINT). The agent listens on no port: every exchange is a call it makes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time

from heteroflow_agent import config as agent_config
from heteroflow_agent import delivery
from heteroflow_agent.channels.images import ImageChannel
from heteroflow_agent.channels.slices import SliceChannel
from heteroflow_agent.client import ServerClient
from heteroflow_agent.collect import ContainerEngine
from heteroflow_agent.engines import launch
from heteroflow_agent.engines.router import EngineRouter
from heteroflow_agent.executor import Executor
from heteroflow_agent.heartbeat import Heartbeat, TaskReport
from heteroflow_agent.logs import LogShipper
from heteroflow_agent.model_cache.ensure import ModelEnsurer, server_report
from heteroflow_agent.model_cache.image import ImageExporter
from heteroflow_agent.model_cache.store import ModelStore
from heteroflow_agent.reconcile import Reconciler
from heteroflow_agent.version import current

logger = logging.getLogger("heteroflow_agent")


TASK_POLL_SECONDS = 5.0
RECONCILE_SECONDS = 60.0
# the image channel's test hook (never set on a real node): remove a pulled image before its check
TEST_REMOVE_AFTER_PULL = agent_config.TEST_REMOVE_AFTER_PULL


def choose_runtime(cfg: agent_config.AgentConfig, engine: ContainerEngine):
    """docker when a container engine answers, else the process runtime when the
    operator allowed it (its tasks run as `process_user`), else none (the node reports
    itself not executable). Returns (the runtime or None, why the process runtime refuses
    to run tasks as configured: "" when it does not)."""
    state = engine.state()
    if state.available:
        from heteroflow_agent.runtime.docker import DockerRuntime

        return DockerRuntime(), ""
    if cfg.allow_process_runtime:
        from heteroflow_agent.runtime.process import ProcessRuntime, ProcessUserRefused, task_user

        try:
            user = task_user(cfg.process_user, allow_root=cfg.process_run_as_root)
        except ProcessUserRefused as refused:
            logger.error("the process runtime will run no tasks: %s", refused)
            return None, str(refused)
        if user is None and os.geteuid() == 0:
            logger.warning("process-runtime tasks run as root (process_run_as_root is set)")
        elif user is not None:
            logger.info("process-runtime tasks run as %s (uid %s)", user.name, user.uid)
        runtime = ProcessRuntime(cfg.data_dir / "process-tasks", user=user)
        if problem := runtime.reach_problem():
            logger.warning("%s", problem)
        return runtime, ""
    logger.warning(
        "no container engine (%s) and the process runtime is not allowed: this node will run no tasks", state.error
    )
    return None, ""


def build(cfg: agent_config.AgentConfig) -> tuple[Heartbeat, Executor | None]:
    from heteroflow_agent.detect import Detector

    version = current()
    client = ServerClient(
        cfg.server_url,
        cfg.api_key,
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        user_agent=f"heteroflow-agent/{version.version}",
    )
    detector = Detector(timeout=cfg.tool_timeout, health_every=cfg.health_interval)
    engine = ContainerEngine()
    runtime, process_refusal = choose_runtime(cfg, engine)
    executor = None
    if runtime is not None:
        reports = delivery.report_client(
            cfg.server_url,
            cfg.api_key,
            attempts=cfg.report_attempts,
            deadline=cfg.report_deadline_seconds,  # then the outcome is kept for the reconciler
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
            user_agent=f"heteroflow-agent/{version.version}",
        )
        executor = Executor(
            cfg.node_id,
            client,
            runtime,
            vendor=detector.detect().vendor,
            report_client=reports,
            engine_python=cfg.engine_python or sys.executable,
            state_dir=cfg.data_dir,  # undelivered outcomes survive a restart
        )
        executor.logs = LogShipper(
            cfg.node_id,
            ServerClient(
                cfg.server_url,
                cfg.api_key,
                connect_timeout=cfg.connect_timeout,
                read_timeout=cfg.read_timeout,
                user_agent=f"heteroflow-agent/{version.version}",
            ),
            runtime,
            cfg.data_dir,
            rate=cfg.log_rate_bytes,
            spool_bytes=cfg.log_spool_bytes,
            keep_bytes=cfg.log_keep_bytes,
            ship_every=cfg.log_ship_seconds,
        )
        executor.models = ModelEnsurer(
            ModelStore(cfg.model_cache_dir, cfg.model_cache_bytes),
            mirror=cfg.model_hub_url,
            hub_api=cfg.model_hub_api,
            images=ImageExporter(runtime) if runtime.kind == "docker" else None,
            report=server_report(client, cfg.node_id),
            progress_interval=cfg.model_progress_seconds,
        )
    process = runtime is not None and runtime.kind == "process"
    heartbeat = Heartbeat(
        cfg,
        client,
        detect_gpus=detector.detect,
        engine=engine,
        version=version,
        tasks=executor.report if executor else TaskReport,
        on_scheduled=(lambda ids: executor.wake.set()) if executor else None,
        on_delivered=executor.sweep.set if executor else None,
        process_engines=(lambda: launch.installed_engines(cfg.engine_python or sys.executable)) if process else None,
        process_refusal=process_refusal,
    )
    if executor is not None:
        # the probe's latest result, read each time the router is asked (never frozen)
        executor.router = EngineRouter(
            lambda: detector.vendor,
            lambda: heartbeat.engines,
            priorities=cfg.engine_priorities,
            images=cfg.engine_images,
            runtime=runtime.kind,
        )
    return heartbeat, executor


def build_slice_channel(cfg: agent_config.AgentConfig, client: ServerClient) -> SliceChannel:
    """The slice command channel: its own poller and worker threads, so a slow driver call
    never holds up the task executor or the beat. It polls with the agent's `client` (a
    wrong key is logged once for the whole agent) and reports with its own retrying one."""
    reports = ServerClient(
        cfg.server_url,
        cfg.api_key,
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        attempts=cfg.report_attempts,
        backoff=1.0,
        backoff_cap=10.0,
        user_agent=f"heteroflow-agent/{current().version}",
    )
    return SliceChannel(
        cfg.node_id,
        client,
        report_client=reports,
        tool_timeout=max(cfg.tool_timeout, 60.0),  # a MIG create takes seconds, not the beat's 10 s
    )


def run_executor(
    executor: Executor,
    stop: threading.Event,
    poll_seconds: float = TASK_POLL_SECONDS,
    reconcile_seconds: float = RECONCILE_SECONDS,
) -> None:
    reconciler = Reconciler(executor)
    # The first reconcile (adopting what an earlier agent left, reporting what vanished)
    # waits for a heartbeat to get through: after the last agent's farewell the node is
    # offline on the server, and a task reported lost then is judged with no node online
    # to run it (failed, not requeued).
    next_reconcile = math.inf
    heard = False
    # Polls fall halfway between heartbeats (both start now): a task scheduled to this
    # node is seen by whichever comes first (a heartbeat answer wakes the poll).
    shift = poll_seconds / 2
    while not stop.is_set():
        if not heard and executor.sweep.is_set():
            heard, next_reconcile = True, time.monotonic()
        if executor.sweep.is_set() and time.monotonic() < next_reconcile:
            executor.sweep.clear()
            try:
                removed = reconciler.sweep_zombies()
                if removed:
                    logger.info("zombies removed: %s", removed)
            except Exception:
                logger.exception("zombie sweep failed")
        if time.monotonic() >= next_reconcile:
            try:
                done = reconciler.run_once()
                if any(done.values()):
                    logger.info("reconcile: %s", {k: v for k, v in done.items() if v})
            except Exception:
                logger.exception("reconcile failed")
            next_reconcile = time.monotonic() + reconcile_seconds
        try:
            executor.poll()
        except Exception:
            logger.exception("task poll failed")
        # the next poll in 5 s, or at once when a heartbeat answer says tasks are waiting
        deadline = time.monotonic() + (shift or poll_seconds)
        shift = 0.0
        while not stop.is_set() and not executor.wake.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                break
        executor.wake.clear()


def build_image_channel(cfg: agent_config.AgentConfig, runtime) -> ImageChannel | None:
    """The image channel when tasks run in a container engine (docker runtime), else None.
    Its own server client: its calls never queue behind the beat's or the executor's."""
    if runtime is None or runtime.kind != "docker":
        return None
    client = ServerClient(
        cfg.server_url,
        cfg.api_key,
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        attempts=cfg.report_attempts,
        backoff=1.0,
        backoff_cap=10.0,
        user_agent=f"heteroflow-agent/{current().version}",
    )
    after_pull = None
    if os.environ.get(TEST_REMOVE_AFTER_PULL) == "1":
        # a test hook (tests/faults/test_image_channel.py): the pulled image is removed
        # before its check, to show the server refusing "pulled but not there"
        def after_pull(reference: str) -> None:
            logger.warning("%s=1: removing %s before its check (a test hook)", TEST_REMOVE_AFTER_PULL, reference)
            channel._engine().images.remove(reference, force=True)

    channel = ImageChannel(
        cfg.node_id,
        client,
        progress_seconds=cfg.image_progress_seconds,
        legacy_latest=cfg.image_legacy_latest,
        auth_file=cfg.image_auth_file or None,
        after_pull=after_pull,
    )
    return channel


def start_tunnel(cfg: agent_config.AgentConfig, runtime, client: ServerClient, stop: threading.Event) -> None:
    """The outbound tunnel (tunnel.py) in a thread of its own. It registers with the
    agent's `client`, as the slice channel polls with it: a wrong key is logged once for
    the whole agent."""
    from heteroflow_agent import tunnel

    docker_exec = tunnel.docker_exec_with(runtime.engine_client) if runtime.kind == "docker" else None
    keeper = tunnel.Tunnel(cfg.node_id, cfg.server_url, client, cfg.data_dir, runtime, docker_exec=docker_exec)
    threading.Thread(target=keeper.run, args=(stop,), name="tunnel", daemon=True).start()


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
    parser.add_argument(
        "--config", help=f"configuration file (default: $HETEROFLOW_AGENT_CONFIG or {agent_config.DEFAULT_CONFIG_FILE})"
    )
    parser.add_argument("--once", action="store_true", help="send one heartbeat and exit (0 if it was accepted)")
    parser.add_argument(
        "--print-payload", action="store_true", help="print the heartbeat this node would send, send nothing"
    )
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
    unknown = agent_config.unknown_environment(os.environ)
    if unknown:  # once, at start: a misspelt setting is never silently ignored
        logger.warning("environment variables this agent does not read, ignored: %s", ", ".join(unknown))
    heartbeat, executor = build(cfg)
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
        version.version,
        version.git_commit,
        version.build_time,
        cfg.node_id,
        cfg.server_url,
        cfg.heartbeat_interval,
    )
    if version.dirty:
        logger.warning("this agent was built from a tree with uncommitted changes (%s)", version.git_commit)
    channel = build_image_channel(cfg, executor.runtime if executor is not None else None)
    if channel is not None:
        logger.info("image channel: polling for image requests every %.0f s", channel.poll_seconds)
        threading.Thread(target=channel.run, args=(stop,), name="image-channel", daemon=True).start()
    worker = None
    if executor is not None:
        logger.info("runtime: %s", executor.runtime.kind)
        worker = threading.Thread(
            target=run_executor,
            args=(executor, stop),
            name="executor",
            daemon=True,
            kwargs={"reconcile_seconds": cfg.reconcile_interval},
        )
        worker.start()
        threading.Thread(target=executor.logs.run, args=(stop,), name="live-logs", daemon=True).start()
    if executor is not None and cfg.tunnel:
        start_tunnel(cfg, executor.runtime, heartbeat.client, stop)
    slices = build_slice_channel(cfg, heartbeat.client)
    slices.start()
    try:
        return run(heartbeat, stop)
    finally:
        slices.close()
        # the heartbeat loop has returned; stop taking and watching tasks (they keep
        # running: the next agent process adopts them)
        if worker is not None:
            worker.join(timeout=30)
            executor.close()
        if heartbeat.beat(farewell=True) is not None:
            logger.info("told the control plane this node is going offline")
        heartbeat.client.close()
        logger.info("heteroflow-agent stopped")


if __name__ == "__main__":
    sys.exit(main())
