"""`hf`, the HeteroFlow command line: a thin layer over the SDK (heteroflow_client.client).

Only Click and the standard library are imported here: the SDK (httpx, PyYAML,
jsonschema, Rich) loads when a command needs it, so `hf --version` and `hf --help` start
at once. Exit statuses: 0 done; 1 the API refused (its message and fields), a job file's
problem, a task that failed (`hf run --follow` exits with the task's own exit code);
2 no key or a refused one (run `hf login`), or a server that cannot be reached.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import click

from heteroflow_client._version import __version__
from heteroflow_client.errors import HeteroFlowError, TaskFailed

FORMATS = ("table", "json", "yaml")
ACTIVE = (
    "pending",
    "scheduled",
    "starting",
    "running",
    "stopping",
    "draining",
    "sleeping",
    "waking",
    "paused",
    "preempting",
)
STATUSES = (*ACTIVE, "cancelled", "completed", "failed", "stopped")
GROUP_STATUSES = ("pending", "scheduled", "running", "stopping", "completed", "failed", "stopped")


class State:
    def __init__(self, profile: str | None, output: str | None, debug: bool):
        self.profile = profile
        self.output = output or "table"
        self.debug = debug
        self._client = None

    @property
    def client(self):
        if self._client is None:
            from heteroflow_client.client import Client

            self._client = Client(profile=self.profile, debug=self.debug)
        return self._client


def state() -> State:
    return click.get_current_context().find_object(State)


def fmt() -> str:
    return state().output


def report(error: BaseException, debug: bool) -> None:
    if debug:
        import traceback

        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    text = str(error) or type(error).__name__
    lines = text.splitlines() or [text]
    click.echo(f"hf: error: {lines[0]}", err=True)
    for line in lines[1:]:
        click.echo(f"  {line}" if not line.startswith("  ") else line, err=True)


class HfGroup(click.Group):
    """Turns the SDK's errors into a message and an exit status (no traceback unless
    --debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except HeteroFlowError as error:
            report(error, self._debug(ctx))
            ctx.exit(error.exit_code)
        except KeyboardInterrupt:
            click.echo("", err=True)
            ctx.exit(130)
        except TimeoutError as error:
            report(error, self._debug(ctx))
            ctx.exit(1)
        except Exception as error:  # a bug or a surprise: say so, without a traceback
            report(error, self._debug(ctx))
            if not self._debug(ctx):
                click.echo("  (run with --debug for the traceback)", err=True)
            ctx.exit(1)

    @staticmethod
    def _debug(ctx: click.Context) -> bool:
        found = ctx.find_object(State)
        return bool(found and found.debug)


def output_option(command):
    """`-o table|json|yaml` on every command (the global one's value otherwise)."""

    def remember(ctx, param, value):
        if value:
            ctx.find_object(State).output = value
        return value

    return click.option(
        "-o",
        "--output",
        type=click.Choice(FORMATS),
        expose_value=False,
        callback=remember,
        help="Output format (default: table).",
    )(command)


def example(*lines: str) -> str:
    return "\b\nExample:\n" + "\n".join(f"  {line}" for line in lines)


@click.group(cls=HfGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="hf", message="%(prog)s %(version)s")
@click.option("--profile", help="Config profile to use (default: HETEROFLOW_PROFILE, or the default one).")
@click.option("-o", "--output", type=click.Choice(FORMATS), help="Output format (default: table).")
@click.option("--debug", is_flag=True, help="Show requests and tracebacks.")
@click.pass_context
def cli(ctx: click.Context, profile: str | None, output: str | None, debug: bool) -> None:
    """HeteroFlow: run tasks, task groups and inference services on a GPU fleet.

    \b
    First:   hf login --url http://127.0.0.1:3333
    Then:    hf run --image busybox --gpus 0 -- echo hello
    """
    ctx.obj = State(profile, output, debug)


# --- configuration ---------------------------------------------------------------------------


@cli.command(
    epilog=example("hf login --url http://127.0.0.1:3333", "hf login --url https://hf.example.com --profile prod")
)
@click.option("--url", help="The control plane's URL (default: HETEROFLOW_URL, or the profile's).")
@click.option("--key", help="An API key (sk-tenant-… or sk-admin-…); asked for when left out.")
@click.option("--profile", "name", help="Profile to save it as (default: the current one).")
@click.option("--default", "make_default", is_flag=True, help="Make this profile the default.")
@output_option
def login(url: str | None, key: str | None, name: str | None, make_default: bool) -> None:
    """Check an API key against the server and save it in a profile."""
    import os

    from heteroflow_client import config
    from heteroflow_client.client import Client

    current = state()
    stored = config.read_file()
    name = name or current.profile or os.environ.get(config.ENV_PROFILE) or stored.get("default_profile") or "default"
    profile = (stored.get("profiles") or {}).get(name) or {}
    url = url or os.environ.get(config.ENV_URL) or profile.get("url")
    if not url:
        raise click.UsageError("give the server's URL: hf login --url http://HOST:3333")
    if not key:
        key = click.prompt("API key", hide_input=True).strip()
    with Client(url=url, key=key, debug=current.debug) as client:
        me = client.me()
    path = config.save_profile(name, url, key, make_default=make_default)
    if fmt() != "table":
        from heteroflow_client.output import dump

        click.echo(dump({"profile": name, "url": url, "config": str(path), "me": me.raw}, fmt()))
        return
    where = f"tenant {me.tenant} as {me.role}" if me.tenant else "as a platform operator"
    click.echo(f"Logged in to {url} as {me.username} ({where}); saved as profile {name!r} in {path}.")


@cli.command(epilog=example("hf logout --profile prod"))
@click.option("--profile", "name", help="Profile to remove (default: the current one).")
def logout(name: str | None) -> None:
    """Forget a profile's URL and key."""
    from heteroflow_client import config

    name = name or state().profile or config.resolve().profile
    if config.remove_profile(name):
        click.echo(f"Removed profile {name!r}.")
    else:
        click.echo(f"No profile {name!r}.", err=True)


@cli.command(epilog=example("hf whoami"))
@output_option
def whoami() -> None:
    """Who the key acts as: user, tenant, role."""
    from heteroflow_client.output import fields, show

    client = state().client
    me = client.me()
    rows = [
        ("server", lambda m: client.url),
        ("profile", lambda m: client.profile),
        ("kind", lambda m: m.kind),
        ("user", lambda m: m.username),
        ("tenant", lambda m: m.tenant),
        ("role", lambda m: m.role),
    ]
    show(me, fmt(), lambda: fields(me, rows))


# --- tasks -------------------------------------------------------------------------------------


def parse_env(pairs: tuple) -> dict:
    env = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals or not name:
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--env")
        env[name] = value
    return env


def exit_status(code: int | None) -> int:
    if code is None:
        return 1
    if code < 0:  # killed by a signal, as the shell says it
        return min(128 - code, 255)
    return code if code <= 255 else 1


def print_line(line, prefix: str = "") -> None:
    text = f"{prefix}{line.text}"
    if line.stream == "stderr":
        click.echo(text, err=True)
    elif line.stream == "system":
        click.echo(click.style(f"{prefix}[{line.stream}] {line.text}", dim=True), err=True)
    else:
        click.echo(text)


def follow_task(client, ident: int, *, tail=None, since=None) -> int:
    """Print the task's log until it ends; its exit status for `hf`."""

    def status(now):
        if now and now not in ("running",):
            click.echo(click.style(f"task {ident}: {now}", dim=True), err=True)

    def retry(why):
        click.echo(click.style(f"hf: {why}; reconnecting…", dim=True), err=True)

    stream = client.tasks.logs(ident, True, tail=tail, since=since, on_status=status, on_retry=retry)
    for line in stream:
        print_line(line)
    task = client.tasks.get(ident)
    code = stream.end.exit_code if stream.end and stream.end.exit_code is not None else task.exit_code
    if task.status == "completed":
        return exit_status(code if code is not None else 0)
    if not task.started_at:
        reason = task.error_message or reason_words(task.schedule_reason) or f"the task is {task.status}"
        raise TaskFailed(ident, task.status, reason)
    if code is None:
        click.echo(f"hf: task {ident} {task.status}: {task.error_message or 'no exit code'}", err=True)
        return 1
    if task.error_message:
        click.echo(f"hf: task {ident} {task.status}: {task.error_message}", err=True)
    return exit_status(code)


@cli.command(
    context_settings={"allow_interspersed_args": False},
    epilog=example(
        "hf run --image busybox --gpus 0 -- sh -c 'echo hello'",
        "hf run --image registry.local/trainer:1 --gpus 2 --gpu-type nvidia --env EPOCHS=3 --follow -- python train.py",
        "hf run -f job.yaml --follow",
    ),
)
@click.option("--name", help="Task name (default: the command's first word).")
@click.option("--image", help="Container image (the process runtime ignores it, but the API needs one).")
@click.option("--gpus", type=click.IntRange(0), help="Whole GPUs (API default 1; 0 with --gpu-memory: a slice).")
@click.option("--gpu-type", help="GPU vendor: nvidia, ascend, amd, …")
@click.option("--gpu-memory", "gpu_memory", type=click.IntRange(1), help="GPU memory in MB.")
@click.option("--priority", type=click.IntRange(0, 100), help="0-100 (default 50).")
@click.option(
    "--max-duration",
    "max_duration",
    type=click.IntRange(1),
    metavar="SECONDS",
    help="How long it runs at most (stopped past it); lets it backfill cards a waiting gang holds.",
)
@click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE", help="An environment variable (repeatable).")
@click.option(
    "--app",
    type=click.Choice(("jupyter", "shell")),
    help="An interactive task running this app (no command): open it with hf open.",
)
@click.option("--idle-minutes", "idle_minutes", type=click.IntRange(1), help="--app: stopped after this long idle.")
@click.option("--max-hours", "max_hours", type=click.FloatRange(0.1), help="--app: how long it runs at most.")
@click.option("-f", "--file", "file", type=click.Path(dir_okay=False), help="A job file with one `kind: task`.")
@click.option("--follow", "-F", is_flag=True, help="Stream the log; exit with the task's exit code.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@output_option
def run(
    name,
    image,
    gpus,
    gpu_type,
    gpu_memory,
    priority,
    max_duration,
    env_pairs,
    app,
    idle_minutes,
    max_hours,
    file,
    follow,
    command,
) -> None:
    """Queue a task and print its id (the command goes after --)."""
    client = state().client
    interactive = {}
    if app:
        interactive = {"task_kind": "interactive", "app": app, "idle_minutes": idle_minutes, "max_hours": max_hours}
    elif idle_minutes or max_hours:
        raise click.UsageError("--idle-minutes and --max-hours are for an interactive task: give --app too")
    task = client.run(
        list(command) or None,
        name=name or (f"{app}" if app else None),
        image=image,
        gpus=gpus,
        gpu_type=gpu_type,
        gpu_memory_mb=gpu_memory,
        priority=priority,
        max_duration_seconds=max_duration,
        env=parse_env(env_pairs),
        file=file,
        **interactive,
    )
    if fmt() == "table":
        if follow:
            click.echo(f"task {task.id} queued; following its log (Ctrl-C leaves it running)", err=True)
        else:
            click.echo(task.id)
    else:
        from heteroflow_client.output import dump

        click.echo(dump(task, fmt()))
    if follow:
        sys.exit(follow_task(client, task.id))


def task_rows():
    from heteroflow_client.output import age

    return [
        ("ID", lambda t: t.id),
        ("NAME", lambda t: t.name),
        ("STATUS", lambda t: t.status),
        ("GPUS", lambda t: gpus_text(t.raw)),
        ("NODE", lambda t: t.node),
        ("AGE", lambda t: age(t.created_at)),
        ("STARTS", lambda t: start_words(t.raw.get("estimated_start"), short=True) if t.status == "pending" else None),
        ("EXIT", lambda t: t.exit_code),
    ]


def start_words(estimate: dict | None, short: bool = False, now=None) -> str | None:
    """A waiting task's estimated start (the server's `estimated_start`) in words: 'now',
    'in 2h (p90 5h)', or why there is none ('?' in a table). None before the first estimate."""
    from datetime import datetime, timezone

    from heteroflow_client.output import parse_time

    if not estimate:
        return None
    p50, p90 = parse_time(estimate.get("p50")), parse_time(estimate.get("p90"))
    if p50 is None:
        return "?" if short else f"unknown: {estimate.get('basis', '')}"
    now = now or datetime.now(timezone.utc)

    def until(at) -> str:
        seconds = int((at - now).total_seconds())
        if seconds < 60:
            return "now"
        for size, unit in ((86_400, "d"), (3_600, "h"), (60, "m")):
            if seconds >= size:
                return f"in {seconds // size}{unit}"
        return "now"

    words = until(p50)
    if p90 is not None and until(p90) != words:
        words += f" (p90 {until(p90).removeprefix('in ')})"
    if short:
        return words
    return f"{words}, at {estimate['p50']}; {estimate.get('basis', '')}"


def gpus_text(raw: dict) -> str:
    count, memory, vendor = raw.get("gpu_required"), raw.get("gpu_memory_mb"), raw.get("gpu_type")
    text = str(count if count is not None else "-")
    if memory:
        text += f" ({memory} MB)"
    if vendor:
        text += f" {vendor}"
    return text


@cli.command(epilog=example("hf ps", "hf ps --all -n 100", "hf ps --status failed -o json"))
@click.option("--status", type=click.Choice(STATUSES), help="Only tasks in this status.")
@click.option("--all", "-a", "everything", is_flag=True, help="Finished tasks too.")
@click.option("--limit", "-n", type=click.IntRange(1, 500), default=50, show_default=True, help="How many.")
@output_option
def ps(status, everything, limit) -> None:
    """List your tasks, newest first: the active ones (all with --all)."""
    from heteroflow_client.output import show, table

    tasks = state().client.tasks.list(status=status, all=everything, limit=limit)
    show(
        tasks,
        fmt(),
        lambda: table(tasks, task_rows(), empty="no tasks" + ("" if everything else " (--all for finished ones)")),
    )


@cli.command(epilog=example("hf show 42", "hf show 42 -o yaml"))
@click.argument("task_id")
@output_option
def show(task_id) -> None:
    """Show one task."""
    from heteroflow_client.output import age, fields
    from heteroflow_client.output import show as emit

    task = state().client.tasks.get(task_id)
    rows = [
        ("id", lambda t: t.id),
        ("name", lambda t: t.name),
        ("tenant", lambda t: t.tenant),
        ("kind", lambda t: t.kind),
        ("status", lambda t: t.status),
        ("image", lambda t: t.image),
        ("command", lambda t: " ".join(map(str, t.command))),
        ("gpus", lambda t: gpus_text(t.raw)),
        ("priority", lambda t: t.priority),
        ("node", lambda t: t.node),
        ("host port", lambda t: t.host_port),
        ("created", lambda t: f"{t.created_at} ({age(t.created_at)} ago)"),
        ("started", lambda t: t.started_at),
        ("finished", lambda t: t.finished_at),
        ("exit code", lambda t: t.exit_code),
        ("error", lambda t: t.error_message),
        ("waiting because", lambda t: reason_words(t.schedule_reason) if t.status == "pending" else None),
        ("expected start", lambda t: start_words(t.raw.get("estimated_start")) if t.status == "pending" else None),
    ]
    emit(task, fmt(), lambda: fields(task, rows))


@cli.command(
    epilog=example(
        "hf logs 42", "hf logs 42 -f --tail 100", "hf logs 42 --since 10m", "hf logs 7 --rank 0 -f  (7: a task group)"
    )
)
@click.argument("ident")
@click.option("-f", "--follow", is_flag=True, help="Keep printing lines until it ends.")
@click.option("--rank", type=click.IntRange(0), help="ID is a task group's: only this rank's lines.")
@click.option("--group", "-g", "is_group", is_flag=True, help="ID is a task group's: every rank's lines.")
@click.option("--tail", type=click.IntRange(0), help="Only the last N lines.")
@click.option("--since", metavar="DURATION", help="Only lines since then: 10m, 2h, or an ISO 8601 time.")
@output_option
def logs(ident, follow, rank, is_group, tail, since) -> None:
    """Print a task's log (a task group's with --group or --rank)."""
    client = state().client
    if is_group or rank is not None:
        sys.exit(print_group_log(client, ident, follow=follow, rank=rank, tail=tail, since=since))
    if follow and fmt() == "table":
        sys.exit(follow_task(client, int(ident), tail=tail, since=since))
    stream = client.tasks.logs(ident, follow, tail=tail, since=since)
    for line in stream:
        if fmt() == "table":
            print_line(line)
        else:
            from heteroflow_client.output import dump

            click.echo(dump([line.raw or {"seq": line.seq, "text": line.text, "stream": line.stream}], fmt()))


@cli.command(epilog=example("hf stop 42", "hf stop 42 43 44"))
@click.argument("task_ids", nargs=-1, required=True)
@output_option
def stop(task_ids) -> None:
    """Stop tasks (a queued one is cancelled, a running one asked to stop)."""
    from heteroflow_client.output import show, table

    client = state().client
    stopped = [client.tasks.stop(ident) for ident in task_ids]
    show(stopped, fmt(), lambda: table(stopped, status_rows()))


def status_rows():
    """A task's id, name and status: what a command that moved tasks prints."""
    return [("ID", lambda t: t.id), ("NAME", lambda t: t.name), ("STATUS", lambda t: t.status)]


# --- why a task waits --------------------------------------------------------------------------

CODES = {
    "InsufficientResources": "no node has room for it now",
    "NoSchedulableNodes": "no node can take it (none online and executable, or all filtered out)",
    "NoTenantEligibleGPU": "no GPU that your tenant may use fits it",
    "SliceUnplannable": "its GPU slice could not be planned on the card chosen",
    "PreemptionPending": "lower-priority preemptible tasks are being stopped to make room",
    "LoanPending": "idle inference replicas of its tenant are stopping to lend it their cards",
}
REMOVED = {
    "unavailable": "offline, silent or not executable",
    "tenant": "dedicated to another tenant",
    "load": "too busy (CPU or memory)",
    "capacity": "without enough free GPUs or GPU memory",
    "tenant_sharing": "whose cards are held by a tenant yours may not share with",
    "rdma": "without RDMA",
    "nvlink": "without an NVLink domain large enough",
    "ports": "without a free host port",
    "cordoned": "whose free cards are cordoned",
    "memory_in_use": "whose cards' measured memory use leaves too little",
    "reserved": "whose cards are held for a waiting task group",
    "runtime": "that cannot run its runtime",
    "affinity": "without the labels it asks for",
    "anti_affinity": "with a label it avoids",
    "same_service": "already holding a replica of its service",
    "model_pinned": "not among the nodes its model is pinned to",
    "inference_cap": "already running the most inference replicas a node may",
}


def reason_words(reason: dict | None) -> str:
    if not reason:
        return ""
    code = reason.get("code", "")
    words = CODES.get(code, code)
    if reason.get("message"):
        words += f": {reason['message']}"
    removed = reason.get("removed_by") or {}
    if removed:
        parts = [
            f"{count} node{'s' if count != 1 else ''} {REMOVED.get(name, name)}" for name, count in removed.items()
        ]
        words += " (" + "; ".join(parts) + ")"
    preemption = reason.get("preemption") or {}
    if preemption.get("node_id"):
        victims = ", ".join(map(str, preemption.get("victims", [])))
        words += f"; making room on {preemption['node_id']} by preempting task(s) {victims}"
    loan = reason.get("loan") or {}
    if loan.get("node_id"):
        words += f"; borrowing on {loan['node_id']} from " + ", ".join(map(loan_words, loan.get("services", [])))
    return words


def loan_words(service: dict) -> str:
    """One service's part of a loan: `chat (service 7): 2 replicas, put to sleep`."""
    count = service.get("replicas", 0)
    how = ", put to sleep" if service.get("sleeps") else ""
    plural = "s" if count != 1 else ""
    return f"{service.get('name') or 'service'} (service {service.get('service_id')}): {count} replica{plural}{how}"


def explain_words(answer: dict) -> list[str]:
    ident, status = answer.get("task_id", answer.get("group_id")), answer.get("status")
    what = "task" if "task_id" in answer else "task group"
    if status != "pending":
        lines = [f"{what.capitalize()} {ident} is {status}: it is not waiting to be placed."]
        for loan in answer.get("loans") or []:
            lines.append(
                f"It holds cards lent by {loan_words(loan)} since {loan.get('since', '?')}; "
                "traffic to that service takes them back (the task is preempted)."
            )
        return lines
    lines = [f"{what.capitalize()} {ident} is pending."]
    last = answer.get("schedule_reason") or {}
    if last:
        lines.append(f"Last scheduler cycle: {reason_words(last)}.")
    else:
        lines.append("No scheduler cycle has looked at it yet.")
    now = answer.get("now")
    if now:
        if now.get("placed"):
            where = now.get("node_id") or ", ".join(sorted({w.get("node_id", "") for w in now.get("workers", [])}))
            cards = now.get("gpu_indices")
            lines.append(
                f"Now it would fit on {where}"
                + (f" (GPUs {', '.join(map(str, cards))})" if cards else "")
                + ": the next cycle should place it."
            )
        else:
            lines.append(f"Now: {reason_words(now.get('reason') or {}) or 'it would not fit'}.")
            for card in (now.get("reason") or {}).get("cards", []):
                lines.append(
                    f"  {card['node_id']} GPU {card['gpu_index']}: {card['measured_free_mb']} MB free by its reading "
                    f"({card['ledger_free_mb']} MB by the ledger, {card['reserve_mb']} MB reserve), "
                    f"{card['needed_mb']} MB needed"
                )
    if answer.get("reservation"):
        lines.append(f"Reservation: {answer['reservation']}")
    suggestions = answer.get("suggestions") or []
    if suggestions:
        lines.append("What would start it:")
        for row in suggestions:
            change = ", ".join(f"{field}={change_words(value)}" for field, value in (row.get("change") or {}).items())
            starts = row.get("starts")
            when = {"now": "starts now", "after moves": "starts after the moves"}.get(
                starts, f"starts at about {starts}"
            )
            lines.append(f"  {change or 'no change'} ({when}): {row.get('why', '')}")
    return lines


STARTS_WORDS = {"now": "starts now", "after moves": "starts after the moves"}


def change_words(value) -> str:
    """A changed field's value as `hf run` would take it: text, or JSON for a mapping."""
    if isinstance(value, (dict, list)) or value is None:
        return json.dumps(value, separators=(",", ":"))
    return str(value)


@cli.command(epilog=example("hf explain 42"))
@click.argument("task_id")
@output_option
def explain(task_id) -> None:
    """Why a task is pending, in words."""
    from heteroflow_client.output import dump

    answer = state().client.tasks.explain(task_id)
    if fmt() != "table":
        click.echo(dump(answer, fmt()))
        return
    for line in explain_words(answer):
        click.echo(line)


@cli.command(epilog=example("hf resubmit 42 gpu_required=4", "hf resubmit 42 gpu_type=ascend affinity=null"))
@click.argument("task_id")
@click.argument("changes", nargs=-1, required=True)
@output_option
def resubmit(task_id, changes) -> None:
    """Queue a waiting task again with a change (one `hf explain` suggests) and cancel it."""
    from heteroflow_client.output import show, table

    change = {}
    for pair in changes:
        field, equals, text = pair.partition("=")
        if not equals or not field:
            raise click.BadParameter(f"{pair!r}: give FIELD=VALUE, as `hf explain` prints them.")
        try:
            change[field] = json.loads(text)
        except ValueError:
            change[field] = text
    new = state().client.tasks.resubmit(task_id, change)
    show(new, fmt(), lambda: table([new], status_rows()))


# --- job files -----------------------------------------------------------------------------------


def created_rows():
    return [
        ("KIND", lambda r: type(r).__name__.lower().replace("taskgroup", "group")),
        ("ID", lambda r: r.raw.get("ids") and f"{r.raw['ids'][0]}…{r.raw['ids'][-1]}" or r.id),
        ("NAME", lambda r: getattr(r, "name", "")),
        ("STATUS", lambda r: getattr(r, "status", "") or getattr(r, "state", "")),
    ]


@cli.command(epilog=example("hf apply -f jobs.yaml", "hf apply -f jobs.yaml --dry-run"))
@click.option(
    "-f",
    "--file",
    "file",
    required=True,
    type=click.Path(dir_okay=False),
    help="Job file (YAML, --- between documents).",
)
@click.option("--dry-run", is_flag=True, help="Only check the file against the server's schema.")
@output_option
def apply(file, dry_run) -> None:
    """Create every task, group and service a job file describes (all checked first)."""
    from heteroflow_client.output import show, table

    client = state().client
    if dry_run:
        documents = client.validate(file)
        click.echo(f"{file}: {len(documents)} document(s), valid.")
        return
    created = client.apply(file)
    show(created, fmt(), lambda: table(created, created_rows()))


def single_document(client, file: str, kind: str):
    from heteroflow_client import jobfiles
    from heteroflow_client.errors import ValidationError

    documents = jobfiles.load(file)
    if len(documents) != 1:
        raise ValidationError(file, None, None, None, f"expected one document (`kind: {kind}`), found {len(documents)}")
    document = documents[0]
    if isinstance(document.data, dict) and "kind" not in document.data:
        document.data = {"kind": kind, **document.data}
    if document.kind != kind:
        raise ValidationError(file, None, None, "kind", f"this command takes `kind: {kind}`, not {document.kind!r}")
    jobfiles.validated([document], client.http)
    return document


# --- task groups ---------------------------------------------------------------------------------


@cli.group(cls=HfGroup)
def group() -> None:
    """Task groups: distributed training, one task per rank."""


def group_rows():
    from heteroflow_client.output import age

    return [
        ("ID", lambda g: g.id),
        ("NAME", lambda g: g.name),
        ("STATUS", lambda g: g.status),
        ("WORKERS", lambda g: f"{g.world_size} × {g.raw.get('gpus_per_worker')} {g.gpu_type}"),
        ("STRATEGY", lambda g: g.strategy),
        ("ATTEMPTS", lambda g: g.attempts),
        ("AGE", lambda g: age(g.created_at)),
    ]


def print_group_log(client, ident, *, follow: bool, rank=None, tail=None, since=None) -> int:
    def retry(why):
        click.echo(click.style(f"hf: {why}; reconnecting…", dim=True), err=True)

    stream = client.groups.logs(ident, follow, rank=rank, tail=tail, since=since, on_retry=retry)
    for line in stream:
        print_line(line, prefix=f"[rank {line.rank}] " if line.rank is not None else "")
    if not follow:
        return 0
    end = stream.end
    if end is None:
        return 1
    if end.status == "completed":
        return 0
    codes = [code for _, code in sorted(end.exit_codes.items()) if code]
    click.echo(
        f"hf: task group {ident} {end.status}" + (f" (exit codes {end.exit_codes})" if end.exit_codes else ""), err=True
    )
    return exit_status(codes[0]) if codes else 1


@group.command("run", epilog=example("hf group run -f train.yaml --follow"))
@click.option(
    "-f", "--file", "file", required=True, type=click.Path(dir_okay=False), help="Job file with `kind: group`."
)
@click.option("--follow", "-F", is_flag=True, help="Stream every rank's log, [rank N] first.")
@output_option
def group_run(file, follow) -> None:
    """Queue a task group from a job file and print its id."""
    client = state().client
    document = single_document(client, file, "group")
    created = client.submit(document)
    if fmt() == "table":
        click.echo(
            created.id if not follow else f"task group {created.id} queued ({created.raw.get('world_size')} ranks)",
            err=follow,
        )
    else:
        from heteroflow_client.output import dump

        click.echo(dump(created, fmt()))
    if follow:
        sys.exit(print_group_log(client, created.id, follow=True))


@group.command("ps", epilog=example("hf group ps", "hf group ps --status running"))
@click.option("--status", type=click.Choice(GROUP_STATUSES))
@click.option("--limit", "-n", type=click.IntRange(1, 500), default=50, show_default=True)
@output_option
def group_ps(status, limit) -> None:
    """List task groups, newest first."""
    from heteroflow_client.output import show, table

    groups = state().client.groups.list(status=status, limit=limit)
    show(groups, fmt(), lambda: table(groups, group_rows(), empty="no task groups"))


@group.command("show", epilog=example("hf group show 7"))
@click.argument("group_id")
@output_option
def group_show(group_id) -> None:
    """Show a task group and its ranks."""
    from heteroflow_client.output import show, table

    found = state().client.groups.get(group_id)

    def render():
        table([found], group_rows())
        members = found.members
        table(
            members,
            [
                ("RANK", lambda m: m.get("rank")),
                ("TASK", lambda m: m.get("id")),
                ("STATUS", lambda m: m.get("status")),
                ("NODE", lambda m: m.get("node")),
                ("GPUS", lambda m: m.get("gpu_indices")),
                ("EXIT", lambda m: m.get("exit_code")),
            ],
        )
        if found.status == "pending" and found.schedule_reason:
            click.echo(f"waiting because: {reason_words(found.schedule_reason)}")
        if found.status == "pending" and found.raw.get("estimated_start"):
            click.echo(f"expected start: {start_words(found.raw['estimated_start'])}")

    show(found, fmt(), render)


@group.command("stop", epilog=example("hf group stop 7"))
@click.argument("group_ids", nargs=-1, required=True)
@output_option
def group_stop(group_ids) -> None:
    """Stop task groups (every rank)."""
    from heteroflow_client.output import show, table

    client = state().client
    stopped = [client.groups.stop(ident) for ident in group_ids]
    show(stopped, fmt(), lambda: table(stopped, group_rows()))


@group.command("logs", epilog=example("hf group logs 7 -f", "hf group logs 7 --rank 1"))
@click.argument("group_id")
@click.option("-f", "--follow", is_flag=True)
@click.option("--rank", type=click.IntRange(0))
@click.option("--tail", type=click.IntRange(0))
@click.option("--since", metavar="DURATION")
def group_logs(group_id, follow, rank, tail, since) -> None:
    """Print a task group's log, each line after [rank N]."""
    sys.exit(print_group_log(state().client, group_id, follow=follow, rank=rank, tail=tail, since=since))


@group.command("explain", epilog=example("hf group explain 7"))
@click.argument("group_id")
@output_option
def group_explain(group_id) -> None:
    """Why a task group is pending."""
    from heteroflow_client.output import dump

    answer = state().client.groups.explain(group_id)
    if fmt() != "table":
        click.echo(dump(answer, fmt()))
        return
    for line in explain_words(answer):
        click.echo(line)


# --- inference ---------------------------------------------------------------------------------


def service_rows():
    return [
        ("ID", lambda s: s.id),
        ("NAME", lambda s: s.name),
        ("MODEL", lambda s: s.model),
        ("ENGINE", lambda s: s.engine),
        ("STATE", lambda s: s.state),
        ("REPLICAS", lambda s: f"{s.replicas} ({s.min_replicas}-{s.max_replicas})"),
        ("GPUS", lambda s: f"{s.gpus_per_replica} {s.gpu_type}"),
        ("LENDS", lambda s: "yes" if s.lendable else "no"),
    ]


@cli.command(epilog=example("hf serve -f service.yaml"))
@click.option(
    "-f", "--file", "file", required=True, type=click.Path(dir_okay=False), help="Job file with `kind: service`."
)
@output_option
def serve(file) -> None:
    """Deploy an inference service from a job file."""
    from heteroflow_client.output import show, table

    client = state().client
    created = client.submit(single_document(client, file, "service"))
    show(created, fmt(), lambda: table([created], service_rows()))


@cli.command(epilog=example("hf services", "hf services -o json"))
@click.option("--state", "service_state", help="Only services in this state.")
@output_option
def services(service_state) -> None:
    """List inference services."""
    from heteroflow_client.output import show, table

    found = state().client.services.list(state=service_state)
    show(found, fmt(), lambda: table(found, service_rows(), empty="no inference services"))


@cli.command(epilog=example("hf scale chat 3"))
@click.argument("service")
@click.argument("replicas", type=click.IntRange(0))
@output_option
def scale(service, replicas) -> None:
    """Set an inference service's replicas (by name or id)."""
    from heteroflow_client.output import show, table

    scaled = state().client.services.scale(service, replicas)
    show(scaled, fmt(), lambda: table([scaled], service_rows()))


@cli.command(epilog=example("hf models"))
@output_option
def models() -> None:
    """List the tenant's models."""
    from heteroflow_client.output import show, table

    found = state().client.models.list()
    rows = [
        ("ID", lambda m: m.id),
        ("NAME", lambda m: m.name),
        ("FORMAT", lambda m: m.format),
        ("SOURCE", lambda m: f"{m.source_kind}: {m.source}"),
        ("ENGINES", lambda m: m.engines),
        ("CACHED ON", lambda m: [c.get("node_name") for c in m.cached_on]),
    ]
    show(found, fmt(), lambda: table(found, rows, empty="no models"))


@cli.command(epilog=example("hf nodes", "hf nodes --status online"))
@click.option("--status", type=click.Choice(("online", "suspect", "offline", "degraded")))
@click.option("--gpu-type", help="Only nodes with this vendor's GPUs.")
@output_option
def nodes(status, gpu_type) -> None:
    """List the nodes you can use and their GPUs."""
    from heteroflow_client.output import age, show, table

    found = state().client.nodes.list(status=status, gpu_type=gpu_type)
    rows = [
        ("ID", lambda n: n.id),
        ("NAME", lambda n: n.name),
        ("STATUS", lambda n: n.status),
        ("GPUS", lambda n: f"{n.gpu_used}/{n.gpu_count} used" + (f", {n.gpus_lost} lost" if n.gpus_lost else "")),
        ("MODEL", lambda n: n.gpu_model or n.gpu_type),
        ("RUNTIME", lambda n: n.exec_mode),
        ("TENANT", lambda n: n.tenant or "shared"),
        ("BEAT", lambda n: age(n.last_heartbeat_at)),
    ]
    show(found, fmt(), lambda: table(found, rows, empty="no nodes"))


# --- live view ---------------------------------------------------------------------------------


def top_rows(client, window: str = "1m") -> list[dict]:
    """The caller's running tasks, each with its cards' latest utilisation, memory and
    power: the task's metrics when the server has them, else its node's cards."""
    tasks = client.tasks.list(status="running", limit=100)
    rows, node_cache = [], {}
    metrics_missing = False
    for task in tasks:
        gpus, source = [], "task"
        if not metrics_missing:
            from heteroflow_client.errors import NotFound

            try:
                samples = client.tasks.metrics(task, window).get("samples") or []
                gpus = samples[-1].get("gpus", []) if samples else []
            except NotFound:
                metrics_missing = True
        if metrics_missing and task.node:
            if task.node not in node_cache:
                node_cache[task.node] = client.nodes.get(task.node)
            node = node_cache[task.node]
            held = set(task.raw.get("gpu_indices") or [])
            slice_info = task.raw.get("slice") or {}
            if slice_info.get("gpu_index") is not None:
                held = {slice_info["gpu_index"]}
            if not held and not task.gpu_required and not task.gpu_memory_mb:
                gpus = []  # it holds no card
            else:
                gpus = [g for g in node.gpus if not held or g.get("index") in held]
            source = "cards" if held else "node"
        rows.append({"task": task, "gpus": gpus, "source": source})
    return rows


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def top_table(rows: list[dict]):
    from rich import box
    from rich.table import Table

    grid = Table(box=box.SIMPLE_HEAD, title=f"hf top — {time.strftime('%H:%M:%S')}", show_edge=False)
    for header in ("ID", "NAME", "NODE", "GPUS", "UTIL %", "MEMORY MB", "POWER W", "FROM"):
        grid.add_column(header)
    for row in rows:
        task, gpus = row["task"], row["gpus"]
        util = _mean([g.get("utilization") for g in gpus])
        memory = sum(g.get("memory_used_mb") or 0 for g in gpus) if gpus else None
        power = sum(g.get("power_w") or 0 for g in gpus) if any(g.get("power_w") is not None for g in gpus) else None
        grid.add_row(
            str(task.id),
            task.name,
            task.node or "-",
            ",".join(str(g.get("index")) for g in gpus) or "-",
            "-" if util is None else f"{util:.0f}",
            "-" if memory is None else f"{memory:.0f}",
            "-" if power is None else f"{power:.0f}",
            row["source"],
        )
    if not rows:
        grid.caption = "no running tasks"
    return grid


@cli.command(epilog=example("hf top", "hf top --once -o json"))
@click.option("--interval", type=click.FloatRange(1), default=5.0, show_default=True, help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one view and exit.")
@output_option
def top(interval, once) -> None:
    """A live view of your running tasks and their GPUs (refreshed every 5 s)."""
    from heteroflow_client.output import console, dump

    client = state().client
    if fmt() != "table":
        rows = top_rows(client)
        click.echo(dump([{"task": r["task"].raw, "gpus": r["gpus"], "from": r["source"]} for r in rows], fmt()))
        return
    if once:
        console().print(top_table(top_rows(client)))
        return
    from rich.live import Live

    with Live(top_table(top_rows(client)), console=console(), auto_refresh=False, screen=False) as live:
        while True:
            time.sleep(interval)
            live.update(top_table(top_rows(client)), refresh=True)


# --- endpoint keys and usage ---------------------------------------------------------------------


def key_rows():
    from heteroflow_client.output import age

    return [
        ("ID", lambda k: k.id),
        ("NAME", lambda k: k.name),
        ("PREFIX", lambda k: k.display_prefix),
        ("MODELS", lambda k: k.allowed_models or "all"),
        ("ACTIVE", lambda k: k.active),
        ("LAST USED", lambda k: age(k.last_used_at)),
    ]


@cli.group(
    cls=HfGroup,
    invoke_without_command=True,
    epilog=example("hf keys", "hf keys create laptop --model qwen3-8b", "hf keys revoke 3"),
)
@output_option
@click.pass_context
def keys(ctx) -> None:
    """Endpoint keys (sk-hf-) for the OpenAI-compatible /v1 endpoints: list, create, revoke."""
    if ctx.invoked_subcommand is None:
        from heteroflow_client.output import show, table

        found = state().client.keys.list()
        show(found, fmt(), lambda: table(found, key_rows(), empty="no endpoint keys"))


@keys.command("create", epilog=example("hf keys create laptop --model qwen3-8b --rpm 600"))
@click.argument("name")
@click.option("--model", "models_", multiple=True, help="A model the key may call (repeatable; default: all).")
@click.option("--rpm", type=click.IntRange(1), help="Requests per minute.")
@click.option("--tpm", type=click.IntRange(1), help="Tokens per minute.")
@click.option("--concurrency", type=click.IntRange(1), help="Requests at once.")
@click.option("--expires", help="ISO 8601 time it stops working.")
@output_option
def keys_create(name, models_, rpm, tpm, concurrency, expires) -> None:
    """Create an endpoint key (shown once)."""
    from heteroflow_client.output import dump

    created = state().client.keys.create(
        name,
        allowed_models=list(models_) or None,
        rpm_limit=rpm,
        tpm_limit=tpm,
        concurrency_limit=concurrency,
        expires_at=expires,
    )
    if fmt() != "table":
        click.echo(dump(created, fmt()))
        return
    click.echo(f"Endpoint key {created.id} ({created.name}); it is shown only now:", err=True)
    click.echo(created.key)


@keys.command("revoke", epilog=example("hf keys revoke 3"))
@click.argument("key_ids", nargs=-1, required=True)
def keys_revoke(key_ids) -> None:
    """Revoke endpoint keys."""
    client = state().client
    for ident in key_ids:
        client.keys.revoke(ident)
        click.echo(f"revoked {ident}")


@cli.command(epilog=example("hf usage", "hf usage --since 2026-12-01T00:00:00Z --model qwen3-8b"))
@click.option("--since", help="ISO 8601: the endpoint usage from then on.")
@click.option("--until", help="ISO 8601: before then.")
@click.option("--model", help="One model's usage.")
@output_option
def usage(since, until, model) -> None:
    """Your tasks' GPU time and your endpoint keys' usage."""
    from heteroflow_client.output import show, table

    found = state().client.usage(since=since, until=until, model=model)

    def render():
        tasks = found["tasks"]
        held = tasks.get("gpus_held", 0)
        hours = (tasks.get("gpu_seconds_settled") or 0) / 3600
        counts = ", ".join(f"{n} {s}" for s, n in tasks.get("by_status", {}).items() if n)
        click.echo(
            f"Tasks: {tasks.get('total', 0)} ({counts or 'none'}); {held} GPU(s) held now; "
            f"{hours:.2f} GPU-hours settled."
        )
        totals = found["gateway"].get("totals") or []
        table(
            totals,
            [
                ("KEY", lambda t: t.get("key_name") or t.get("key")),
                ("MODEL", lambda t: t.get("model")),
                ("REQUESTS", lambda t: t.get("requests")),
                ("ERRORS", lambda t: t.get("errors")),
                ("PROMPT TOKENS", lambda t: t.get("prompt_tokens")),
                ("COMPLETION TOKENS", lambda t: t.get("completion_tokens")),
                ("GPU-SECONDS", lambda t: f"{t.get('gpu_seconds') or 0:.2f}"),
            ],
            empty="no endpoint usage",
        )

    show(found, fmt(), render)


# --- replays under other policies (docs/simulate.md on the server) -----------------------------


def read_yaml(path: str, what: str):
    import yaml

    try:
        with open(path) as handle:
            return yaml.safe_load(handle)
    except OSError as exc:
        raise click.BadParameter(f"{path}: {exc.strerror}", param_hint=what) from None
    except yaml.YAMLError as exc:
        raise click.BadParameter(f"{path}: not YAML ({exc})", param_hint=what) from None


def read_trace_rows(path: str) -> list[dict]:
    """A JSONL trace's rows (the server checks each one and names a bad row)."""
    rows = []
    try:
        with open(path) as handle:
            lines = handle.readlines()
    except OSError as exc:
        raise click.BadParameter(f"{path}: {exc.strerror}", param_hint="-f") from None
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise click.BadParameter(f"{path}, line {number}: not JSON ({exc})", param_hint="-f") from None
    return rows


def minutes(seconds) -> str:
    return "—" if seconds is None else f"{seconds / 60:.1f}m"


@cli.command(
    epilog=example(
        "hf simulate --history 7d --policy binpack.yaml --compare spread.yaml --out sim/",
        "hf simulate --generate 3000 --days 2 --fleet fleet.yaml --policy binpack.yaml",
        "hf simulate -f trace.jsonl --fleet fleet.yaml",
    )
)
@click.option("--history", "history", help="This cluster's work submitted in the last 7d, 36h or 90m.")
@click.option("--generate", "generate", type=click.IntRange(1, 200_000), help="A generated trace of this many jobs.")
@click.option("--days", type=click.FloatRange(0.01, 31), default=2.0, show_default=True, help="Its span.")
@click.option("--seed", type=int, default=1, show_default=True, help="Its seed.")
@click.option("-f", "--trace", "trace", help="A JSONL trace (submit, gpus, duration, …).")
@click.option("--fleet", help="A fleet file (YAML, nodes: …); default: this cluster now.")
@click.option("--policy", "policies", multiple=True, help="A policy file (YAML); default: this cluster's.")
@click.option("--compare", "compare", multiple=True, help="Another policy file, run beside it.")
@click.option("--out", help="Save report.json and the charts (PNG) in this folder.")
@click.option("--no-wait", is_flag=True, help="Queue it, print its id and return.")
@output_option
def simulate(history, generate, days, seed, trace, fleet, policies, compare, out, no_wait) -> None:
    """Replay work under other policies on the real scheduler (operators)."""
    from heteroflow_client.output import dump, show, table

    given = [option for option, value in (("--history", history), ("--generate", generate), ("-f", trace)) if value]
    if len(given) != 1:
        raise click.UsageError("Give exactly one of --history, --generate and -f.")
    if history:
        units = {"d": 1.0, "h": 1 / 24, "m": 1 / 1440}
        try:
            work = {"from_history_days": float(history[:-1]) * units[history[-1]]}
        except (KeyError, ValueError, IndexError):
            raise click.BadParameter(f"{history!r}: 7d, 36h or 90m", param_hint="--history") from None
    elif generate:
        work = {"generate": {"jobs": generate, "days": days, "seed": seed}}
    else:
        work = {"trace": read_trace_rows(trace)}
    request = {
        "work": work,
        "fleet": read_yaml(fleet, "--fleet") if fleet else None,
        "policies": [read_yaml(path, "--policy") for path in (*policies, *compare)],
    }
    for path, document in zip((*policies, *compare), request["policies"], strict=True):
        if isinstance(document, dict):
            document.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    client = state().client
    found = client.simulations.create(request)
    if no_wait:
        show(found, fmt(), lambda: click.echo(f"Simulation {found['id']} queued."))
        return
    found = follow_simulation(client, found)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "report.json"), "w") as handle:
            handle.write(json.dumps(found.get("report"), indent=2))
        for url in found.get("charts", []):
            with open(os.path.join(out, url.rsplit("/", 1)[-1]), "wb") as handle:
                handle.write(client.simulations.chart(url))
    if found["state"] != "done":
        raise click.ClickException(
            f"Simulation {found['id']} {found['state']}: {found.get('error') or 'no reason given'}"
        )
    runs = (found.get("report") or {}).get("runs", [])
    if fmt() != "table":
        click.echo(dump(found.get("report"), fmt()))
        return
    table(
        runs,
        [
            ("POLICY", lambda r: r["policy"]),
            ("PLACED", lambda r: f"{r['placed']}/{r['jobs']}"),
            ("UTILISATION", lambda r: f"{100 * r['utilisation_mean']:.1f}%"),
            ("WAIT P50", lambda r: minutes(r["wait_seconds"]["p50"])),
            ("P90", lambda r: minutes(r["wait_seconds"]["p90"])),
            ("P99", lambda r: minutes(r["wait_seconds"]["p99"])),
            ("STRANDED CARDS", lambda r: r["fragmentation"]["idle_cards_on_partly_used_nodes_mean"]),
        ],
    )
    if out:
        click.echo(f"Saved report.json and {len(found.get('charts', []))} charts in {out}.")


def follow_simulation(client, found: dict) -> dict:
    """Poll a queued replay until it ends, showing its progress (a bar on a terminal)."""
    from rich.progress import Progress

    with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
        bar = progress.add_task(f"simulation {found['id']}", total=100)
        while found["state"] in ("queued", "running"):
            time.sleep(1.0)
            found = client.simulations.get(found["id"])
            progress.update(bar, completed=100 * found.get("progress", 0))
    return found


# --- shell completion ----------------------------------------------------------------------------


# --- into a running task: the tunnel (docs/tunnel.md) ---------------------------------


def parse_ports(mapping: str) -> tuple[int, int]:
    local, sep, remote = mapping.partition(":")
    if not sep:
        local, remote = mapping, mapping
    try:
        ports = int(local), int(remote)
    except ValueError:
        raise click.BadParameter(f"{mapping!r}: LOCAL:REMOTE, two port numbers (LOCAL 0: any free port)") from None
    if not (0 <= ports[0] <= 65535 and 1 <= ports[1] <= 65535):
        raise click.BadParameter(f"{mapping!r}: ports are 1-65535 (LOCAL 0: any free port)")
    return ports


@cli.command(
    "port-forward",
    epilog=example("hf port-forward 42 8888:8888", "hf port-forward 42 0:8080   # any free local port"),
)
@click.argument("task_id")
@click.argument("ports", metavar="LOCAL:REMOTE")
@click.option("--rank", type=click.IntRange(0), help="TASK is a member of a group: reach this rank's task instead.")
@click.option("--address", default="127.0.0.1", show_default=True, help="The local address to listen on.")
def port_forward(task_id, ports, rank, address) -> None:
    """Forward a local port to a port of a running task, through the control plane (the
    node needs no open port). Runs until Ctrl-C."""
    from heteroflow_client import tunnel

    local, remote = parse_ports(ports)

    def ready(port: int) -> None:
        click.echo(f"Forwarding {address}:{port} -> task {task_id} port {remote} (Ctrl-C to stop)", err=True)

    tunnel.port_forward(state().client, task_id, local, remote, rank=rank, bind=address, on_ready=ready)


@cli.command(
    "exec",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    epilog=example("hf exec 42 -- nvidia-smi", "hf exec 42 --rank 1 -- python -c 'import os; print(os.getcwd())'"),
)
@click.argument("task_id")
@click.option("--rank", type=click.IntRange(0), help="TASK is a member of a group: run in this rank's task.")
@click.option("--tty/--no-tty", "-t", default=None, help="A terminal (default: when stdin is one).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(task_id, rank, tty, command) -> None:
    """Run a command in a running task (its container, or its process's environment);
    exits with the command's exit status."""
    from heteroflow_client import tunnel

    argv = list(command)
    if argv[:1] == ["--"]:  # `hf exec 42 -- CMD`: the separator is not the command's
        argv = argv[1:]
    if not argv:
        raise click.UsageError("a command to run: hf exec TASK -- CMD [ARGS]…")
    sys.exit(tunnel.exec_command(state().client, task_id, argv, rank=rank, tty=tty))


@cli.command(
    "open",
    epilog=example(
        "hf run --app jupyter --gpus 1 --image quay.io/jupyter/base-notebook", "hf open 42", "hf open 42 --port 8888"
    ),
)
@click.argument("task_id")
@click.option("--port", "local", type=click.IntRange(0, 65535), default=0, help="The local port (default: any free).")
@click.option("--address", default="127.0.0.1", show_default=True, help="The local address to listen on.")
@click.option("--wait", type=click.FloatRange(0), default=120, show_default=True, help="Seconds to wait for the app.")
def open_(task_id, local, address, wait) -> None:
    """Open an interactive task's app: forward a local port to it and print its URL with
    the app's token (a shell task: a shell, as hf ssh). Runs until Ctrl-C."""
    from heteroflow_client import tunnel

    client = state().client
    app = client.tasks.app(task_id)
    if app["app"] == "shell":
        sys.exit(tunnel.exec_command(client, task_id, [], rank=None, tty=None))

    def ready(port: int) -> None:
        click.echo(f"http://{address}:{port}{app['path']}?token={app['token']}")
        click.echo(f"{app['app']} of task {task_id}: open the URL above (Ctrl-C to stop)", err=True)

    tunnel.wait_for_port(
        client,
        task_id,
        app["port"],
        wait,
        on_wait=lambda: click.echo(f"waiting for {app['app']} to start in task {task_id}…", err=True),
    )
    tunnel.port_forward(client, task_id, local, app["port"], bind=address, on_ready=ready)


@cli.command(epilog=example("hf ssh 42", "hf ssh 42 --rank 3"))
@click.argument("task_id")
@click.option("--rank", type=click.IntRange(0), help="TASK is a member of a group: this rank's task.")
def ssh(task_id, rank) -> None:
    """A shell in a running task (a login shell, on a terminal)."""
    from heteroflow_client import tunnel

    sys.exit(tunnel.exec_command(state().client, task_id, [], rank=rank, tty=None))


@cli.command(epilog=example("hf completion bash >> ~/.bashrc", 'hf completion zsh > "${fpath[1]}/_hf"'))
@click.argument("shell", type=click.Choice(("bash", "zsh", "fish")))
def completion(shell) -> None:
    """Print the shell completion script for bash, zsh or fish."""
    from click.shell_completion import get_completion_class

    complete = get_completion_class(shell)
    click.echo(complete(cli, {}, "hf", "_HF_COMPLETE").source())


def skip_httpx_cli() -> None:
    """httpx imports its own command line (httpx._main) when Click and Rich are
    installed, and with it Rich's progress bars and Pygments' lexers: about 50 ms of every
    `hf` start that makes a request. `hf` never calls it; the SDK imported elsewhere is
    left alone."""
    if "httpx" not in sys.modules and "httpx._main" not in sys.modules:
        import types

        stub = types.ModuleType("httpx._main")

        def unavailable(*args, **kwargs):  # pragma: no cover
            raise SystemExit("httpx's command line is not loaded inside hf")

        stub.main = unavailable  # type: ignore[attr-defined]
        sys.modules["httpx._main"] = stub


def main() -> None:
    skip_httpx_cli()
    cli(prog_name="hf")


if __name__ == "__main__":  # pragma: no cover
    main()
