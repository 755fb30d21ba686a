"""The heteroflow_* metrics that processes count as things happen. Those that describe
the cluster as it is (nodes, GPUs, the queue, alerts) are computed at scrape time
instead, from the database (apps.monitoring.exposition), so every instance agrees.

Counters and histograms only: with PROMETHEUS_MULTIPROC_DIR set each process writes
them to its own file and the exporter adds the files up, which is right for these two
kinds (a gauge would need a rule for combining processes). Label values come from fixed
sets (reason codes, job and task names declared in code), never from requests.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram, disable_created_metrics

from apps.core.error_codes import CoreErrorCode

# The *_created series double the output and no rule or panel uses them.
disable_created_metrics()

# --- scheduling ---------------------------------------------------------------------------

TASKS_SCHEDULED = Counter("heteroflow_tasks_scheduled", "Tasks bound to a node by the scheduler.")
SCHEDULE_LATENCY = Histogram(
    "heteroflow_schedule_latency_seconds",
    "Time from a task's creation to its bind to a node.",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600),
)
CYCLE_DURATION = Histogram(
    "heteroflow_scheduler_cycle_duration_seconds",
    "Duration of one scheduler cycle (queue, snapshot, decide, bind, preempt, explain).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
BINDS_PER_CYCLE = Histogram(
    "heteroflow_scheduler_binds_per_cycle",
    "Tasks bound in one scheduler cycle.",
    buckets=(0, 1, 2, 5, 10, 20, 50, 100, 200),
)
BIND_CONFLICTS = Counter(
    "heteroflow_scheduler_bind_conflicts",
    "Decisions that bind refused because the live state had changed (decided again next cycle).",
)


def record_binds(latencies_seconds) -> None:
    """Bound tasks, each with its time from creation to bind."""
    TASKS_SCHEDULED.inc(len(latencies_seconds))
    for latency in latencies_seconds:
        SCHEDULE_LATENCY.observe(max(0.0, latency))


def record_cycle(duration_seconds: float, bound: int, conflicts: int) -> None:
    CYCLE_DURATION.observe(duration_seconds)
    BINDS_PER_CYCLE.observe(bound)
    if conflicts:
        BIND_CONFLICTS.inc(conflicts)


# --- heartbeats ---------------------------------------------------------------------------

HEARTBEATS_RECEIVED = Counter(
    "heteroflow_heartbeats_received", "Heartbeat requests that reached the heartbeat route, applied or not."
)
HEARTBEATS_REJECTED = Counter(
    "heteroflow_heartbeats_rejected", "Heartbeats not applied, by the error code of the answer.", ["reason"]
)
# The heartbeat route's error codes; anything else counts as "other".
HEARTBEAT_REJECT_REASONS = (
    CoreErrorCode.BAD_REQUEST,
    CoreErrorCode.HTTPS_REQUIRED,
    CoreErrorCode.METHOD_NOT_ALLOWED,
    CoreErrorCode.NOT_AUTHENTICATED,
    CoreErrorCode.AUTHENTICATION_FAILED,
    CoreErrorCode.PERMISSION_DENIED,
    CoreErrorCode.INVALID,
    CoreErrorCode.PARSE_ERROR,
    CoreErrorCode.PAYLOAD_TOO_LARGE,
    CoreErrorCode.UNAVAILABLE,
    "other",
)
# Bound once: the heartbeat is the hottest path, and this also shows every reason at 0.
_REJECTED = {reason: HEARTBEATS_REJECTED.labels(reason) for reason in HEARTBEAT_REJECT_REASONS}


AGENT_FIELDS_IGNORED = Counter(
    "heteroflow_agent_fields_ignored",
    "Fields that agents sent and this server does not know (an agent newer than the server), ignored; "
    "by channel (heartbeat, report, event, container_lost) and field name (list indices as []), "
    "the first 64 names seen, then 'other'.",
    ["channel", "field"],
)
IGNORED_FIELD_NAMES_MAX = 64
_ignored_field_names: set[tuple[str, str]] = set()


def record_ignored_agent_fields(channel: str, fields: list[str]) -> list[str]:
    """Count the fields; return those this process had not seen on this channel before
    (the caller logs them once)."""
    new = []
    for name in fields:
        if (channel, name) not in _ignored_field_names:
            if len(_ignored_field_names) >= IGNORED_FIELD_NAMES_MAX:
                AGENT_FIELDS_IGNORED.labels(channel, "other").inc()
                continue
            _ignored_field_names.add((channel, name))
            new.append(name)
        AGENT_FIELDS_IGNORED.labels(channel, name).inc()
    return new


def record_heartbeat(status: int, error_code: str | None) -> None:
    HEARTBEATS_RECEIVED.inc()
    if status != 200:
        _REJECTED.get(error_code or "other", _REJECTED["other"]).inc()


# --- the gateway (/v1/*, apps.gateway.api.route) -----------------------------------------

GATEWAY_ENDPOINTS = ("chat", "completions", "embeddings", "models")
GATEWAY_REQUESTS = Counter(
    "heteroflow_gateway_requests",
    "Requests to the OpenAI-compatible endpoints, by endpoint and status class (2xx, 4xx, 5xx) or "
    "`disconnected` (the client left first).",
    ["endpoint", "outcome"],
)
GATEWAY_DURATION = Histogram(
    "heteroflow_gateway_request_duration_seconds",
    "Time from a /v1/* request's arrival to the end of its answer, by endpoint.",
    ["endpoint"],
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
GATEWAY_FIRST_BYTE = Histogram(
    "heteroflow_gateway_first_byte_seconds",
    "Time from a /v1/* request's arrival to the first byte of its answer sent to the client, by endpoint.",
    ["endpoint"],
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
GATEWAY_TOKENS = Counter("heteroflow_gateway_tokens", "Tokens metered by the gateway, prompt or completion.", ["kind"])
_GW_OUTCOMES = ("2xx", "4xx", "5xx", "disconnected")
_GW_REQUESTS = {(e, o): GATEWAY_REQUESTS.labels(e, o) for e in GATEWAY_ENDPOINTS for o in _GW_OUTCOMES}
_GW_DURATION = {e: GATEWAY_DURATION.labels(e) for e in GATEWAY_ENDPOINTS}
_GW_FIRST_BYTE = {e: GATEWAY_FIRST_BYTE.labels(e) for e in GATEWAY_ENDPOINTS}
_GW_PROMPT, _GW_COMPLETION = GATEWAY_TOKENS.labels("prompt"), GATEWAY_TOKENS.labels("completion")


def record_gateway_request(
    endpoint: str, status: int, *, disconnected: bool, seconds: float, first_byte: float | None
) -> None:
    outcome = "disconnected" if disconnected else f"{min(max(status // 100, 2), 5)}xx"
    if outcome == "3xx":
        outcome = "4xx"
    _GW_REQUESTS[(endpoint, outcome)].inc()
    _GW_DURATION[endpoint].observe(seconds)
    if first_byte is not None:
        _GW_FIRST_BYTE[endpoint].observe(first_byte)


def record_gateway_tokens(prompt: int, completion: int) -> None:
    if prompt:
        _GW_PROMPT.inc(prompt)
    if completion:
        _GW_COMPLETION.inc(completion)


GATEWAY_WITHOUT_REDIS = Counter(
    "heteroflow_gateway_requests_without_redis",
    "Requests to the gateway while Redis was away, by HETEROFLOW_GATEWAY_LIMITS_WITHOUT_REDIS mode (local, "
    "closed, open) and outcome (admitted, refused): admitted by this process's share of the limits, or with "
    "no limit at all.",
    ["mode", "outcome"],
)
_GW_WITHOUT_REDIS = {
    (m, o): GATEWAY_WITHOUT_REDIS.labels(m, o) for m in ("local", "closed", "open") for o in ("admitted", "refused")
}


def record_gateway_without_redis(mode: str, admitted: bool) -> None:
    _GW_WITHOUT_REDIS[(mode, "admitted" if admitted else "refused")].inc()


# --- periodic jobs and Celery -------------------------------------------------------------

TASK_CREATES = Counter(
    "heteroflow_task_create_requests",
    "POST /api/v1/tasks answered by the thin create route (apps.tasks.api.create_route), by status; "
    "Django's request metrics do not see these.",
    ["status"],
)


_CREATE_ANSWERS = {status: TASK_CREATES.labels(str(status)) for status in (201, 400, 401, 403, 404, 409, 500)}


def record_task_create(status: int) -> None:
    (_CREATE_ANSWERS.get(status) or TASK_CREATES.labels(str(status))).inc()


JOB_RUNS = Counter(
    "heteroflow_periodic_job_runs",
    "Deliveries of a periodic job by what the guard made of them (ran, busy, early, failed).",
    ["job", "outcome"],
)
JOB_DURATION = Histogram(
    "heteroflow_periodic_job_duration_seconds",
    "Duration of the periodic jobs that ran (or failed).",
    ["job"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


def job_label(key: str) -> str:
    """A per-host job's guard key carries the host (key@host); the label does not."""
    return key.split("@", 1)[0]


def record_job(key: str, outcome: str, duration_seconds: float | None) -> None:
    job = job_label(key)
    JOB_RUNS.labels(job, outcome).inc()
    if duration_seconds is not None:
        JOB_DURATION.labels(job).observe(duration_seconds)


CELERY_TASKS_PUBLISHED = Counter(
    "heteroflow_celery_tasks_published",
    "Celery tasks this process sent to the broker (beat's ticks among them).",
    ["task"],
)
CELERY_TASK_RUNS = Counter(
    "heteroflow_celery_task_runs",
    "Celery tasks this worker ran, by outcome (success, failure, retry).",
    ["task", "outcome"],
)
CELERY_TASK_DURATION = Histogram(
    "heteroflow_celery_task_duration_seconds",
    "Duration of the Celery tasks this worker ran.",
    ["task"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)


QUEUE_RECLAIMS = Counter(
    "heteroflow_queue_reclaims",
    "Tasks a queue's reclaim stopped (docs/queues.md), by the tenant that reclaimed its nominal.",
    ["tenant"],
)


def record_reclaims(tenant: str, stopped: int) -> None:
    QUEUE_RECLAIMS.labels(tenant).inc(stopped)
