"""Scheduling windows: when a service may run at full strength, and what the 60 s job does
about it. Pure: a window spec and an instant in, answers out (no clock is read here).

A window is a set of days, one or more local time ranges and an IANA time zone. A range
belongs to the day it starts on; one whose end is not after its start runs over midnight
into the next day; `24:00` ends a range at the next midnight (`00:00`–`24:00` is the
whole day). Boundaries are instants: a start or end is the first instant at which the
zone's clock shows that time or later, so a boundary inside a daylight-saving gap falls
on the jump, and one inside a repeated hour falls on its first occurrence (the window
does not reopen when the clock goes back).

Outside the window the job applies the action (pause, scale to N, stop) once and holds the
service (the AutoScaler skips it); back inside, pause and scale restore the count
remembered when the action was applied, stop does not. An action that would add replicas
(scale to more than now, a restore to more than now) is skipped for an inactive tenant
and tried again next round; shrinking and pausing are not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from enum import StrEnum
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # index = date.weekday()
WINDOW_FIELDS = {"days", "ranges", "timezone", "action", "scale_to"}
RANGE_FIELDS = {"start", "end"}
CLOCK = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)$")


class WindowAction(StrEnum):
    PAUSE = "pause"
    SCALE = "scale"
    STOP = "stop"


@dataclass(frozen=True)
class TimeRange:
    start: time
    end: time | None  # None: 24:00, the next midnight

    @property
    def over_midnight(self) -> bool:
        return self.end is None or self.end <= self.start


@dataclass(frozen=True)
class Window:
    days: frozenset[int]  # date.weekday(): 0 Monday … 6 Sunday; the day a range starts on
    ranges: tuple[TimeRange, ...]
    timezone: str  # IANA name
    action: WindowAction
    scale_to: int | None = None  # for action scale

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)


class WindowError(ValueError):
    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = errors


def _clock(value, where: str, errors: list[str], allow_24: bool = False) -> time | None:
    if allow_24 and value == "24:00":
        return None
    if not isinstance(value, str) or not CLOCK.match(value):
        also = ", or 24:00" if allow_24 else ""
        errors.append(f"{where} must be a local time HH:MM (00:00–23:59{also}), not {value!r}")
        return time(0)
    hours, minutes = value.split(":")
    return time(int(hours), int(minutes))


def parse_window(data: Mapping) -> Window:
    """A window from its JSON form, or WindowError listing every problem:

    {"days": ["mon", …], "ranges": [{"start": "09:00", "end": "18:00"}, …],
     "timezone": "Asia/Shanghai", "action": "pause" | "scale" | "stop", "scale_to": 1}
    """
    errors: list[str] = []
    if not isinstance(data, Mapping):
        raise WindowError(["a window must be an object"])
    unknown = sorted(set(data) - WINDOW_FIELDS)
    if unknown:
        errors.append(f"unknown fields: {', '.join(unknown)}")
    days: set[int] = set()
    raw_days = data.get("days")
    if not isinstance(raw_days, list) or not raw_days:
        errors.append(f"days must be a non-empty list of {', '.join(DAYS)}")
    else:
        for day in raw_days:
            if isinstance(day, str) and day.lower() in DAYS:
                days.add(DAYS.index(day.lower()))
            else:
                errors.append(f"unknown day {day!r} (one of {', '.join(DAYS)})")
    ranges: list[TimeRange] = []
    raw_ranges = data.get("ranges")
    if not isinstance(raw_ranges, list) or not raw_ranges:
        errors.append('ranges must be a non-empty list of {"start": "HH:MM", "end": "HH:MM"}')
    else:
        for number, raw in enumerate(raw_ranges, 1):
            if not isinstance(raw, Mapping) or set(raw) != RANGE_FIELDS:
                errors.append(f'range {number} must be {{"start": "HH:MM", "end": "HH:MM"}}')
                continue
            before = len(errors)
            start = _clock(raw["start"], f"range {number} start", errors)
            end = _clock(raw["end"], f"range {number} end", errors, allow_24=True)
            # (a time that did not parse is None, as 24:00 is: compare only two good ones)
            if len(errors) == before and end == start:
                errors.append(f"range {number} starts and ends at {raw['start']}: empty (00:00–24:00 is a whole day)")
            ranges.append(TimeRange(start, end))
    zone = data.get("timezone")
    if not isinstance(zone, str) or not zone:
        errors.append("timezone must be an IANA time zone name such as Asia/Shanghai")
    else:
        try:
            ZoneInfo(zone)
        # OSError: a region's folder ("America"), which the tzdata package's fallback opens
        # as a file (IsADirectoryError) on Pythons before 3.12
        except (ZoneInfoNotFoundError, ValueError, OSError):
            errors.append(f"unknown time zone {zone!r} (an IANA name such as Asia/Shanghai)")
    action = data.get("action")
    if action not in tuple(WindowAction):
        errors.append(f"action must be one of {', '.join(WindowAction)}, not {action!r}")
    scale_to = data.get("scale_to")
    if action == WindowAction.SCALE:
        if not isinstance(scale_to, int) or isinstance(scale_to, bool) or scale_to < 1:
            errors.append("scale_to must be an integer of at least 1 for action scale (pause goes to zero)")
    elif scale_to is not None:
        errors.append(f"scale_to is only for action scale, not {action!r}")
    if errors:
        raise WindowError(errors)
    return Window(frozenset(days), tuple(ranges), zone, WindowAction(action), scale_to)


def validate_window(data: Mapping) -> list[str]:
    """Every problem with a window's JSON form, in words (empty: valid), for the API."""
    try:
        parse_window(data)
    except WindowError as error:
        return error.errors
    return []


def local_instant(day: date, moment: time | None, zone: ZoneInfo) -> datetime:
    """The first instant (UTC) at which the zone's clock shows `moment` on `day` or later.
    None is 24:00 (the next day's midnight)."""
    if moment is None:
        day, moment = day + timedelta(days=1), time(0)
    wall = datetime.combine(day, moment)
    earlier, later = (wall.replace(tzinfo=zone, fold=fold).astimezone(UTC) for fold in (0, 1))
    low, high = min(earlier, later), max(earlier, later)
    if low.astimezone(zone).replace(tzinfo=None) == wall:
        return low  # exists (its first occurrence when the clock goes back)
    # in a gap the clock jumps over `wall`: the boundary is the jump, the first whole second
    # between the two readings whose clock shows `wall` or later (transitions fall on seconds)
    first, last = int(low.timestamp()), int(high.timestamp())
    while last - first > 1:
        middle = (first + last) // 2
        if datetime.fromtimestamp(middle, zone).replace(tzinfo=None) >= wall:
            last = middle
        else:
            first = middle
    return datetime.fromtimestamp(last, UTC)


def intervals(window: Window, start_day: date, end_day: date) -> list[tuple[datetime, datetime]]:
    """The window's open spans (UTC, merged where they touch or overlap) for the ranges
    starting on the days from start_day to end_day."""
    zone = window.zone
    spans = []
    day = start_day
    while day <= end_day:
        if day.weekday() in window.days:
            for span in window.ranges:
                end_day_of_range = day + timedelta(days=1) if span.over_midnight and span.end is not None else day
                spans.append((local_instant(day, span.start, zone), local_instant(end_day_of_range, span.end, zone)))
        day += timedelta(days=1)
    merged: list[tuple[datetime, datetime]] = []
    for begin, finish in sorted(spans):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], finish))
        else:
            merged.append((begin, finish))
    return merged


def _around(window: Window, at: datetime, days_ahead: int = 8) -> list[tuple[datetime, datetime]]:
    if at.tzinfo is None:
        raise ValueError("`at` must be timezone-aware")
    today = at.astimezone(window.zone).date()
    return intervals(window, today - timedelta(days=1), today + timedelta(days=days_ahead))


def inside(window: Window, at: datetime) -> bool:
    """Whether `at` (aware) is inside the window: start included, end excluded."""
    return any(begin <= at < finish for begin, finish in _around(window, at, days_ahead=0))


def next_boundary(window: Window, at: datetime) -> datetime | None:
    """The next instant after `at` at which `inside` changes (UTC), or None when it never
    does (a window open around the clock: a week without a change repeats for ever)."""
    for begin, finish in _around(window, at):
        if begin > at:
            return begin
        if finish > at:
            return None if finish - at >= timedelta(days=7) else finish
    return None


# --- the 60 s job's decision ---------------------------------------------------------------


class WindowMove(StrEnum):
    NONE = "none"  # nothing to do
    APPLY = "apply"  # outside: pause, scale or stop now
    RESTORE = "restore"  # back inside: bring back the remembered count
    RELEASE = "release"  # back inside after stop: drop the hold, restore nothing
    SKIP = "skip"  # would add replicas for an inactive tenant: tried again next round


@dataclass(frozen=True)
class WindowState:
    replicas: int  # the service's current replica count
    held_action: WindowAction | None = None  # the action the window applied and still holds
    remembered: int | None = None  # the count from before it (pause and scale)
    tenant_active: bool = True
    stopped: bool = False  # the service has ended (by a user, or by a window's stop)
    sleeping: bool = False


@dataclass(frozen=True)
class WindowDecision:
    move: WindowMove
    action: WindowAction | None  # the action applied (APPLY) or undone (RESTORE, RELEASE)
    replicas: int  # the count the service should have after the move
    remember: int | None  # the count to keep for the restore (None: forget it)
    holds: bool  # whether the window holds the service after the move (the AutoScaler skips)
    reason: str


def decide(window: Window | None, state: WindowState, at: datetime) -> WindowDecision:
    """What the windows job does for one service at `at`."""
    held = state.held_action is not None

    def keep(reason: str) -> WindowDecision:
        return WindowDecision(WindowMove.NONE, state.held_action, state.replicas, state.remembered, held, reason)

    if window is None:
        if held:  # the window was removed while it held the service: release it as if back inside
            return _back_inside(state, "the window was removed")
        return keep("no window")
    now_inside = inside(window, at)
    if state.stopped:
        if state.held_action == WindowAction.STOP and now_inside:
            return _back_inside(state, "inside the window")
        return keep("the service is stopped")
    if now_inside:
        return _back_inside(state, "inside the window") if held else keep("inside the window")
    at_target = window.action != WindowAction.SCALE or state.replicas == window.scale_to
    if state.held_action == window.action and at_target:
        return keep(f"outside the window, {window.action} holds")
    if state.sleeping and not held:
        return keep("outside the window, sleeping: nothing runs to act on")
    # apply (or switch to the window's current action, keeping the count from before the first)
    remembered = state.remembered if held else state.replicas
    if window.action == WindowAction.STOP:
        return WindowDecision(WindowMove.APPLY, WindowAction.STOP, 0, None, True, "outside the window: stop")
    if window.action == WindowAction.PAUSE:
        return WindowDecision(
            WindowMove.APPLY,
            WindowAction.PAUSE,
            0,
            remembered,
            True,
            f"outside the window: pause ({state.replicas} replicas, {remembered} remembered)",
        )
    target = window.scale_to
    if _adds_for_inactive_tenant(state, target):
        return _skip(state, held, f"outside the window: scale to {target}")
    return WindowDecision(
        WindowMove.APPLY,
        WindowAction.SCALE,
        target,
        remembered,
        True,
        f"outside the window: scale {state.replicas} → {target} ({remembered} remembered)",
    )


def _back_inside(state: WindowState, why: str) -> WindowDecision:
    if state.held_action == WindowAction.STOP:
        return WindowDecision(
            WindowMove.RELEASE, WindowAction.STOP, state.replicas, None, False, f"{why}: stop is not undone"
        )
    target = state.remembered if state.remembered is not None else state.replicas
    if _adds_for_inactive_tenant(state, target):
        return _skip(state, True, f"{why}: restoring {target} replicas")
    return WindowDecision(
        WindowMove.RESTORE,
        state.held_action,
        target,
        None,
        False,
        f"{why}: {state.held_action} undone, {state.replicas} → {target} replicas",
    )


def _adds_for_inactive_tenant(state: WindowState, target: int) -> bool:
    """The spec's rule: a window action that would add replicas is skipped for an
    inactive tenant; shrinking and pausing are not."""
    return target > state.replicas and not state.tenant_active


def _skip(state: WindowState, holds: bool, what: str) -> WindowDecision:
    reason = f"{what} would add replicas and the tenant is inactive: skipped"
    return WindowDecision(WindowMove.SKIP, state.held_action, state.replicas, state.remembered, holds, reason)
