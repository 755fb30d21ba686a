"""The live log panel of the task and training group pages (templates/portal/_log_panel.html,
static/portal/logs.js): what the page hands its script. The script reads the live log API
with the page's session (GET /api/v1/tasks/{id}/logs, /api/v1/task-groups/{id}/logs; the
session's tenant is the one the API's session authentication acts for, so no header is
needed, and an EventSource can send none), scoped like the page, whose object was found
with get_visible_or_404. docs/portal.md#the-live-log-panel says what the panel does."""

from __future__ import annotations

from django.urls import reverse

from apps.tasks.choices import TERMINAL
from apps.tasks.models import Task, TaskGroup

# the panel's numbers, given to the script so that the page and its tests agree
LIMITS = {
    "tail": 1_000,  # lines read when the page opens, before the follow goes on after them
    "bound": 5_000,  # lines kept in the page at most; the oldest leave first
    "earlier": 1_000,  # lines one "Load earlier lines" reads
    "page": 10_000,  # lines a download reads per request (the API's largest page)
}


def task_log_panel(task: Task) -> dict:
    return {
        "kind": "task",
        "url": reverse("task-logs", args=[task.pk]),
        "name": f"task-{task.pk}",
        "status": task.status,
        "ended": task.status in TERMINAL,
        "exit_code": task.exit_code,
        "tails": {"": task.log_tail} if task.log_tail else {},
        "terminal": list(TERMINAL),
        **LIMITS,
    }


def group_log_panel(group: TaskGroup, members: list[Task]) -> dict:
    """A group's log ends when every member has ended (as its follow's `end` does)."""
    return {
        "kind": "group",
        "url": reverse("task-group-logs", args=[group.pk]),
        "name": f"group-{group.pk}",
        "status": group.status,
        "ended": bool(members) and all(task.status in TERMINAL for task in members),
        "exit_codes": {str(task.rank): task.exit_code for task in members},
        "tails": {str(task.rank): task.log_tail for task in members if task.log_tail},
        "ranks": [task.rank for task in members],
        # each member's own log, for its final tail when the group stored no line
        "members": {str(task.rank): reverse("task-logs", args=[task.pk]) for task in members},
        **LIMITS,
    }
