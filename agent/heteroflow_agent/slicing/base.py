"""What the slice vendors share: the outcome, the refusal, the time budget."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from heteroflow_agent.detect.command import DEFAULT_TIMEOUT, ToolResult, find_command, run_tool

REQUEST_SECONDS = 120.0  # the control plane's deadline for one request (claim + run)


class OutOfTime(Exception):
    """The request's time budget is spent: nothing more is run."""


@dataclass
class Outcome:
    ok: bool
    error: str = ""
    created: list[dict] = field(default_factory=list)
    destroyed: list[dict] = field(default_factory=list)
    device_id: str = ""
    handles: dict = field(default_factory=dict)

    def result(self) -> dict:
        """The report's `result` body (the channel's contract in SLICES.md)."""
        body: dict = {"created": self.created, "destroyed": self.destroyed}
        if self.device_id:
            body["device_id"] = self.device_id
        if self.handles:
            body["handles"] = self.handles
        return body


def refused(why: str, **kwargs) -> Outcome:
    """A request that re-validation turned down: nothing was run, nothing changed."""
    return Outcome(False, f"refused: {why}"[:2000], **kwargs)


class Budget:
    """The tools of one request share its time: each runs with the smaller of the tool
    timeout and what is left; with nothing left, OutOfTime."""

    def __init__(self, seconds: float = REQUEST_SECONDS, tool_timeout: float = 60.0, clock=time.monotonic):
        self.clock = clock
        self.deadline = clock() + seconds
        self.seconds = seconds
        self.tool_timeout = tool_timeout

    def left(self) -> float:
        return self.deadline - self.clock()

    def run(self, argv: Sequence[str], *, input: str | None = None) -> ToolResult:
        left = self.left()
        if left <= 0.05:
            raise OutOfTime(f"the {self.seconds:g} s limit of the request ran out")
        return run_tool(argv, min(self.tool_timeout, left), input=input)


class Vendor:
    name = ""
    tool = ""  # the executable the vendor drives, found like the detector finds it

    def __init__(self, root: str = "/"):
        self.root = root

    def path(self) -> str | None:
        return find_command(self.tool, self.root)

    def execute(self, action: str, params: dict, budget: Budget) -> Outcome:
        if action == "create":
            return self.create(params, budget)
        if action == "destroy":
            return self.destroy(params, budget)
        return refused(f"unknown action {action!r}")

    def create(self, params: dict, budget: Budget) -> Outcome:
        raise NotImplementedError

    def destroy(self, params: dict, budget: Budget) -> Outcome:
        raise NotImplementedError


def gpu_index(params: dict) -> int | None:
    value = params.get("gpu_index")
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 64 else None


__all__ = ["DEFAULT_TIMEOUT", "Budget", "OutOfTime", "Outcome", "Vendor", "gpu_index", "refused"]
