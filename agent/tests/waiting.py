"""Waiting in the agent's tests for something another thread or process does."""

from __future__ import annotations

import time

POLL_SECONDS = 0.02


def wait_for(check, timeout: float = 30.0, what: str = "the condition"):
    """Call `check` until it returns something truthy, and return that; fail the test
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(POLL_SECONDS)
