"""Node liveness: the one rule for what a node's silence means (docs/nodes.md#node-status).

Everything is derived from the last heartbeat (`last_heartbeat_at`), the agent's word on
whether it can run work (`executable`) and its farewell (`signed_off_at`), against three
thresholds of silence read from settings (docs/configuration.md):

- HETEROFLOW_NODE_STATUS_SUSPECT_SECONDS (30): the status turns `suspect`;
- HETEROFLOW_NODE_OFFLINE_SECONDS (45): the failure policy gives the node up: the alert
  sweep raises NODE_OFFLINE and requeues its tasks, the capacity verdict stops counting
  it, and the scheduler places nothing more on it;
- HETEROFLOW_NODE_STATUS_OFFLINE_SECONDS (60): the status turns `offline`.

Two questions, then, asked of the same silence. The status answers "what does the node
list show" (the spec's state machine, 30 s / 60 s); `given_up` answers "may work still
count on this node" (the spec's AlertMonitor, 45 s, independent of the state machine).
The second threshold falls inside the suspect band, so from 45 s to 60 s a node *shows*
`suspect` while its NODE_OFFLINE is active. That is by design, not a lag to work around:
whatever decides about work asks `heard_since(now)` (or `given_up`), never the status
column alone.

Each rule exists twice, once in Python for one node and once in SQL for the whole fleet
in one statement; both are built here from the same steps, and
tests/nodes/test_liveness.py checks on a grid of timestamps that they agree. The steps,
in the manner of Healthchecks' Check.get_grace_start / going_down_after / get_status:

    suspect_from(last)    the moment the status turns suspect
    given_up_after(last)  the moment after which the failure policy gives the node up
    offline_from(last)    the moment the status turns offline
    status_at(...)        the status at a moment

and their set-wise mirrors, cut-offs to compare `last_heartbeat_at` with:
`suspect_cutoff(now)`, `heard_since(now)`, `offline_cutoff(now)`.

A node never heard from (registered by hand) shows `offline`; it is not given up either
(it has nothing to lose, and SQL's NULL compares as neither), so the scheduler may place
on it while its status says it is schedulable.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q

from apps.nodes.choices import NodeStatus

# --- the thresholds -------------------------------------------------------------------------


def suspect_after() -> timedelta:
    return timedelta(seconds=settings.HETEROFLOW_NODE_STATUS_SUSPECT_SECONDS)


def give_up_after() -> timedelta:
    return timedelta(seconds=settings.HETEROFLOW_NODE_OFFLINE_SECONDS)


def offline_after() -> timedelta:
    return timedelta(seconds=settings.HETEROFLOW_NODE_STATUS_OFFLINE_SECONDS)


def give_up_seconds() -> int:
    """For messages: "silent for more than N s"."""
    return settings.HETEROFLOW_NODE_OFFLINE_SECONDS


# --- one node ---------------------------------------------------------------------------------


def suspect_from(last_heartbeat_at: datetime) -> datetime:
    return last_heartbeat_at + suspect_after()


def given_up_after(last_heartbeat_at: datetime) -> datetime:
    return last_heartbeat_at + give_up_after()


def offline_from(last_heartbeat_at: datetime) -> datetime:
    return last_heartbeat_at + offline_after()


def signed_off(last_heartbeat_at: datetime, signed_off_at: datetime | None) -> bool:
    """Its latest beat was the agent's farewell: a beat after it clears signed_off_at."""
    return signed_off_at is not None and signed_off_at >= last_heartbeat_at


def status_at(
    last_heartbeat_at: datetime | None,
    executable: bool,
    now: datetime,
    signed_off_at: datetime | None = None,
    gpu_failing: bool = False,
) -> str:
    """The node state machine. Silence wins over executability; a farewell is offline at
    once; a node that cannot run tasks, or whose GPU collector fails as a whole (the
    driver or the vendor tool: `gpu_collector_error`), is degraded. STATUS_SQL is the
    same, set-wise, in the same order."""
    if last_heartbeat_at is None or now >= offline_from(last_heartbeat_at):
        return NodeStatus.OFFLINE
    if signed_off(last_heartbeat_at, signed_off_at):
        return NodeStatus.OFFLINE
    if now >= suspect_from(last_heartbeat_at):
        return NodeStatus.SUSPECT
    return NodeStatus.ONLINE if executable and not gpu_failing else NodeStatus.DEGRADED


def given_up(last_heartbeat_at: datetime | None, now: datetime) -> bool:
    """Whether the failure policy has given the node up (never: a node never heard from).
    A farewell does not count: an agent restart must not requeue the node's tasks."""
    return last_heartbeat_at is not None and now > given_up_after(last_heartbeat_at)


# --- the fleet, set-wise -------------------------------------------------------------------


def suspect_cutoff(now: datetime) -> datetime:
    """Heard from at or before this: suspect (last + suspect_after <= now)."""
    return now - suspect_after()


def heard_since(now: datetime) -> datetime:
    """Heard from at or after this: not given up. Before it: given up."""
    return now - give_up_after()


def offline_cutoff(now: datetime) -> datetime:
    """Heard from at or before this: offline."""
    return now - offline_after()


def status_params(now: datetime) -> dict[str, datetime]:
    """The named parameters STATUS_SQL takes."""
    return {"offline": offline_cutoff(now), "suspect": suspect_cutoff(now)}


# status_at over the nodes table, with %(offline)s and %(suspect)s from status_params(now)
STATUS_SQL = f"""CASE
            WHEN last_heartbeat_at IS NULL OR last_heartbeat_at <= %(offline)s THEN '{NodeStatus.OFFLINE}'
            WHEN signed_off_at >= last_heartbeat_at THEN '{NodeStatus.OFFLINE}'
            WHEN last_heartbeat_at <= %(suspect)s THEN '{NodeStatus.SUSPECT}'
            WHEN executable AND gpu_collector_error = '' THEN '{NodeStatus.ONLINE}'
            ELSE '{NodeStatus.DEGRADED}' END"""


def not_given_up_sql(column: str = "last_heartbeat_at") -> str:
    """`given_up` negated, for a raw query: one positional parameter, heard_since(now).
    (`column < %s` is "given up"; a NULL is neither, hence the explicit IS NULL.)"""
    return f"({column} IS NULL OR {column} >= %s)"


def heard_from_sql(column: str = "last_heartbeat_at", param: str = "%s") -> str:
    """Heard from recently enough that the failure policy counts on the node (a NULL is
    not), for a raw query; `param` is bound to heard_since(now)."""
    return f"{column} >= {param}"


def given_up_q(now: datetime, field: str = "last_heartbeat_at") -> Q:
    """`given_up` for the ORM (`field` may run through a relation: node__last_heartbeat_at)."""
    return Q(**{f"{field}__lt": heard_since(now)})


def heard_from_q(now: datetime, field: str = "last_heartbeat_at") -> Q:
    """Heard from recently enough that the failure policy counts on the node."""
    return Q(**{f"{field}__gte": heard_since(now)})
