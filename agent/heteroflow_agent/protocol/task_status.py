"""The task statuses the agent reads from the control plane and reports to it, spelled as
the server's `apps.tasks.choices.TaskStatus` spells them (tests/nodes/test_agent_contract.py
pins the two together: every name here is one of the server's, TERMINAL is the server's
TERMINAL, and every move in REPORTS is one the server lets an agent make)."""

from __future__ import annotations

PENDING = "pending"
SCHEDULED = "scheduled"
RUNNING = "running"
STOPPING = "stopping"
PREEMPTING = "preempting"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
STOPPED = "stopped"

# the server has ended the task: whatever of it is still on this node is a zombie
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED, STOPPED})
# the server's intents that a running task be ended, and the status that confirms each
# once it has stopped (a stopped task is stopped; a preempted one goes back to the queue)
CONFIRMS: dict[str, str] = {STOPPING: STOPPED, PREEMPTING: PENDING}
# every move the agent reports, from the status it saw: the claim, an outcome, a
# confirmed stop intent
REPORTS: dict[str, frozenset[str]] = {
    SCHEDULED: frozenset({RUNNING}),
    RUNNING: frozenset({COMPLETED, FAILED}),
    **{intent: frozenset({confirmed}) for intent, confirmed in CONFIRMS.items()},
}


def ended(exit_code: int | None) -> str:
    """What an ended task reports: completed on exit code 0, failed on any other or none."""
    return COMPLETED if exit_code == 0 else FAILED
