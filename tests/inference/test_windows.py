"""Scheduling windows (apps/inference/windows.py): the arithmetic in real time zones, over
midnight and across daylight-saving changes, the validation, and the 60 s job's decision."""

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from apps.inference.windows import (
    DAYS,
    WindowAction,
    WindowError,
    WindowMove,
    WindowState,
    decide,
    inside,
    next_boundary,
    parse_window,
    validate_window,
)

WEEKDAYS = ["mon", "tue", "wed", "thu", "fri"]


def window(ranges, days=WEEKDAYS, timezone="Asia/Shanghai", action="pause", scale_to=None):
    data = {
        "days": days,
        "ranges": [{"start": start, "end": end} for start, end in ranges],
        "timezone": timezone,
        "action": action,
    }
    if scale_to is not None:
        data["scale_to"] = scale_to
    return parse_window(data)


def utc(*args):
    return datetime(*args, tzinfo=UTC)


# 2026-12-01 is a Tuesday; Shanghai is UTC+8 all year
OFFICE = window([("09:00", "18:00")])


@pytest.mark.parametrize(
    "at,expected",
    [
        (utc(2026, 12, 1, 0, 59, 59), False),  # Tue 08:59:59 local
        (utc(2026, 12, 1, 1, 0), True),  # Tue 09:00: the start is inside
        (utc(2026, 12, 1, 9, 59, 59), True),  # Tue 17:59:59
        (utc(2026, 12, 1, 10, 0), False),  # Tue 18:00: the end is outside
        (utc(2026, 12, 5, 3, 0), False),  # Sat 11:00: not a window day
        (utc(2026, 11, 30, 20, 0), False),  # Tue 04:00 local although Monday in UTC
        (utc(2026, 12, 1, 1, 0).astimezone(ZoneInfo("America/New_York")), True),  # `at` in any zone
    ],
)
def test_inside_an_office_window_in_shanghai(at, expected):
    assert inside(OFFICE, at) is expected


def test_the_boundaries_are_the_next_start_and_end():
    assert next_boundary(OFFICE, utc(2026, 12, 1, 0, 0)) == utc(2026, 12, 1, 1, 0)
    assert next_boundary(OFFICE, utc(2026, 12, 1, 1, 0)) == utc(2026, 12, 1, 10, 0)  # exactly at start: the end
    # Friday evening: the next start is Monday 09:00
    assert next_boundary(OFFICE, utc(2026, 12, 4, 10, 0)) == utc(2026, 12, 7, 1, 0)


def test_an_aware_instant_is_required():
    with pytest.raises(ValueError, match="timezone-aware"):
        inside(OFFICE, datetime(2026, 12, 1, 9, 0))


NIGHT = window([("22:00", "02:00")], days=["fri"])  # Friday 22:00 to Saturday 02:00, local


@pytest.mark.parametrize(
    "local_day,local_time,expected",
    [
        (4, "21:59", False),  # Fri (2026-12-04)
        (4, "22:00", True),
        (4, "23:59", True),
        (5, "00:00", True),  # Sat: the range started on Friday
        (5, "01:59", True),
        (5, "02:00", False),
        (5, "22:30", False),  # Sat is not a window day
        (6, "01:00", False),  # Sun 01:00: Saturday started no range
    ],
)
def test_a_window_over_midnight_belongs_to_the_day_it_starts(local_day, local_time, expected):
    hours, minutes = map(int, local_time.split(":"))
    at = datetime(2026, 11, 30, hours, minutes, tzinfo=NIGHT.zone) + timedelta(days=local_day)  # Mon 30 Nov
    assert at.weekday() == local_day
    assert inside(NIGHT, at) is expected


def test_over_midnight_boundaries():
    friday_evening = datetime(2026, 12, 4, 20, 0, tzinfo=NIGHT.zone)
    assert next_boundary(NIGHT, friday_evening) == datetime(2026, 12, 4, 22, 0, tzinfo=NIGHT.zone)
    assert next_boundary(NIGHT, datetime(2026, 12, 4, 23, 0, tzinfo=NIGHT.zone)) == datetime(
        2026, 12, 5, 2, 0, tzinfo=NIGHT.zone
    )
    # Saturday 02:00 onwards: next Friday 22:00
    assert next_boundary(NIGHT, datetime(2026, 12, 5, 2, 0, tzinfo=NIGHT.zone)) == datetime(
        2026, 12, 11, 22, 0, tzinfo=NIGHT.zone
    )


def test_day_of_week_edges_of_a_whole_day():
    monday = window([("00:00", "24:00")], days=["mon"], timezone="UTC")
    assert not inside(monday, utc(2026, 11, 29, 23, 59, 59))  # Sun
    assert inside(monday, utc(2026, 11, 30, 0, 0))  # Mon 00:00
    assert inside(monday, utc(2026, 11, 30, 23, 59, 59))
    assert not inside(monday, utc(2026, 12, 1, 0, 0))  # Tue 00:00
    assert next_boundary(monday, utc(2026, 11, 30, 12, 0)) == utc(2026, 12, 1, 0, 0)
    assert next_boundary(monday, utc(2026, 12, 1, 0, 0)) == utc(2026, 12, 7, 0, 0)


def test_a_window_covering_every_whole_day_never_changes():
    always = window([("00:00", "24:00")], days=list(DAYS), timezone="America/New_York")
    for at in (utc(2026, 3, 8, 7, 0), utc(2026, 11, 1, 6, 0), utc(2026, 12, 1, 12, 0)):
        assert inside(always, at)
        assert next_boundary(always, at) is None


def test_consecutive_whole_days_join_into_one_span():
    weekend = window([("00:00", "24:00")], days=["sat", "sun"], timezone="UTC")
    assert next_boundary(weekend, utc(2026, 12, 5, 12, 0)) == utc(2026, 12, 7, 0, 0)  # Mon 00:00, not Sun 00:00


def test_several_ranges_a_day():
    split = window([("09:00", "12:00"), ("13:00", "18:00")], timezone="UTC")
    assert inside(split, utc(2026, 12, 1, 11, 59))
    assert not inside(split, utc(2026, 12, 1, 12, 30))
    assert inside(split, utc(2026, 12, 1, 13, 0))
    assert next_boundary(split, utc(2026, 12, 1, 10, 0)) == utc(2026, 12, 1, 12, 0)
    assert next_boundary(split, utc(2026, 12, 1, 12, 30)) == utc(2026, 12, 1, 13, 0)
    touching = window([("09:00", "12:00"), ("12:00", "18:00")], timezone="UTC")
    assert next_boundary(touching, utc(2026, 12, 1, 10, 0)) == utc(2026, 12, 1, 18, 0)


# --- daylight saving (America/New_York: 2026-03-08 clocks go 02:00 → 03:00, 2026-11-01
# clocks go 02:00 → 01:00) ---------------------------------------------------------------

NEW_YORK_DAILY = window([("09:00", "17:00")], days=list(DAYS), timezone="America/New_York")


def test_a_local_window_follows_the_clock_across_the_spring_change():
    # Saturday 09:00 EST is 14:00 UTC; Sunday (after the change) 09:00 EDT is 13:00 UTC
    assert not inside(NEW_YORK_DAILY, utc(2026, 3, 7, 13, 30))
    assert inside(NEW_YORK_DAILY, utc(2026, 3, 7, 14, 0))
    assert inside(NEW_YORK_DAILY, utc(2026, 3, 8, 13, 0))
    assert next_boundary(NEW_YORK_DAILY, utc(2026, 3, 7, 23, 0)) == utc(2026, 3, 8, 13, 0)
    assert next_boundary(NEW_YORK_DAILY, utc(2026, 3, 8, 13, 0)) == utc(2026, 3, 8, 21, 0)  # 17:00 EDT


def test_a_local_window_follows_the_clock_across_the_autumn_change():
    assert next_boundary(NEW_YORK_DAILY, utc(2026, 10, 31, 22, 0)) == utc(2026, 11, 1, 14, 0)  # 09:00 EST
    assert inside(NEW_YORK_DAILY, utc(2026, 10, 31, 13, 0))  # 09:00 EDT the day before
    assert not inside(NEW_YORK_DAILY, utc(2026, 11, 1, 13, 30))  # 08:30 EST


def test_a_start_inside_the_spring_gap_falls_on_the_jump():
    # 02:30 does not exist on 2026-03-08: the window opens when the clock jumps to 03:00 EDT (07:00 UTC)
    early = window([("02:30", "05:00")], days=["sun"], timezone="America/New_York")
    assert not inside(early, utc(2026, 3, 8, 6, 59, 59))  # 01:59:59 EST
    assert inside(early, utc(2026, 3, 8, 7, 0))  # 03:00 EDT
    assert next_boundary(early, utc(2026, 3, 8, 6, 0)) == utc(2026, 3, 8, 7, 0)
    assert next_boundary(early, utc(2026, 3, 8, 7, 0)) == utc(2026, 3, 8, 9, 0)  # 05:00 EDT
    # the week after, 02:30 exists again
    assert next_boundary(early, utc(2026, 3, 8, 9, 0)) == utc(2026, 3, 15, 6, 30)


def test_an_end_inside_the_repeated_hour_is_its_first_occurrence():
    # Saturday 22:00 EDT to Sunday 01:30: the window ends at the first 01:30 (EDT, 05:30 UTC)
    # and does not reopen when the clock shows 01:00-01:30 again (EST)
    late = window([("22:00", "01:30")], days=["sat"], timezone="America/New_York")
    assert inside(late, utc(2026, 11, 1, 5, 29, 59))
    assert not inside(late, utc(2026, 11, 1, 5, 30))
    assert not inside(late, utc(2026, 11, 1, 6, 10))  # 01:10 EST, the second time round
    assert next_boundary(late, utc(2026, 11, 1, 5, 0)) == utc(2026, 11, 1, 5, 30)
    assert next_boundary(late, utc(2026, 11, 1, 5, 30)) == utc(2026, 11, 8, 3, 0)  # next Sat 22:00 EST


# --- validation ----------------------------------------------------------------------------


def test_a_good_window_parses():
    parsed = window([("22:00", "24:00")], days=["sat", "SUN"], action="scale", scale_to=2)
    assert parsed.days == frozenset({5, 6})
    assert parsed.ranges[0].end is None and parsed.ranges[0].over_midnight
    assert (parsed.action, parsed.scale_to, parsed.timezone) == (WindowAction.SCALE, 2, "Asia/Shanghai")
    assert validate_window({"days": ["mon"], "ranges": [{"start": "00:00", "end": "24:00"}], "timezone": "UTC",
                            "action": "stop"}) == []  # fmt: skip


GOOD = {"days": ["mon"], "ranges": [{"start": "09:00", "end": "18:00"}], "timezone": "UTC", "action": "pause"}


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({"days": []}, "days must be a non-empty list of mon, tue, wed, thu, fri, sat, sun"),
        ({"days": "mon"}, "days must be a non-empty list of mon, tue, wed, thu, fri, sat, sun"),
        ({"days": ["monday"]}, "unknown day 'monday' (one of mon, tue, wed, thu, fri, sat, sun)"),
        ({"days": [1]}, "unknown day 1 (one of mon, tue, wed, thu, fri, sat, sun)"),
        ({"ranges": []}, 'ranges must be a non-empty list of {"start": "HH:MM", "end": "HH:MM"}'),
        ({"ranges": [{"start": "09:00"}]}, 'range 1 must be {"start": "HH:MM", "end": "HH:MM"}'),
        (
            {"ranges": [{"start": "9:00", "end": "18:00"}]},
            "range 1 start must be a local time HH:MM (00:00–23:59), not '9:00'",
        ),
        (
            {"ranges": [{"start": "24:00", "end": "18:00"}]},
            "range 1 start must be a local time HH:MM (00:00–23:59), not '24:00'",
        ),
        (
            {"ranges": [{"start": "09:00", "end": "18:60"}]},
            "range 1 end must be a local time HH:MM (00:00–23:59, or 24:00), not '18:60'",
        ),
        (
            {"ranges": [{"start": "09:00", "end": "09:00"}]},
            "range 1 starts and ends at 09:00: empty (00:00–24:00 is a whole day)",
        ),
        ({"timezone": "Mars/Olympus"}, "unknown time zone 'Mars/Olympus' (an IANA name such as Asia/Shanghai)"),
        ({"timezone": "America"}, "unknown time zone 'America' (an IANA name such as Asia/Shanghai)"),
        ({"timezone": "/etc/passwd"}, "unknown time zone '/etc/passwd' (an IANA name such as Asia/Shanghai)"),
        ({"timezone": ""}, "timezone must be an IANA time zone name such as Asia/Shanghai"),
        ({"action": "sleep"}, "action must be one of pause, scale, stop, not 'sleep'"),
        ({"action": "scale"}, "scale_to must be an integer of at least 1 for action scale (pause goes to zero)"),
        ({"action": "scale", "scale_to": 0}, "scale_to must be an integer of at least 1 for action scale"),
        ({"action": "scale", "scale_to": True}, "scale_to must be an integer of at least 1 for action scale"),
        ({"scale_to": 2}, "scale_to is only for action scale, not 'pause'"),
        ({"every": "day"}, "unknown fields: every"),
    ],
)
def test_bad_windows_are_named(changes, expected):
    errors = validate_window({**GOOD, **changes})
    assert any(error.startswith(expected) for error in errors), errors


def test_every_problem_is_listed_at_once():
    with pytest.raises(WindowError) as caught:
        parse_window({"days": ["xyz"], "ranges": [], "timezone": "Nowhere", "action": None})
    assert len(caught.value.errors) == 4
    assert validate_window("mon-fri") == ["a window must be an object"]


# --- the 60 s job's decision ---------------------------------------------------------------

IN = utc(2026, 12, 1, 3, 0)  # Tue 11:00 Shanghai
OUT = utc(2026, 12, 1, 12, 0)  # Tue 20:00 Shanghai


def test_going_outside_pauses_and_remembers_the_count():
    decision = decide(OFFICE, WindowState(replicas=3), OUT)
    assert (decision.move, decision.action, decision.replicas, decision.remember, decision.holds) == (
        WindowMove.APPLY,
        WindowAction.PAUSE,
        0,
        3,
        True,
    )


def test_going_outside_scales_and_remembers_the_count():
    scale = window([("09:00", "18:00")], action="scale", scale_to=1)
    decision = decide(scale, WindowState(replicas=4), OUT)
    assert (decision.move, decision.replicas, decision.remember, decision.holds) == (WindowMove.APPLY, 1, 4, True)
    assert decision.reason == "outside the window: scale 4 → 1 (4 remembered)"


def test_going_outside_stops_without_remembering():
    stop = window([("09:00", "18:00")], action="stop")
    decision = decide(stop, WindowState(replicas=4), OUT)
    assert (decision.move, decision.action, decision.replicas, decision.remember) == (
        WindowMove.APPLY,
        WindowAction.STOP,
        0,
        None,
    )


def test_outside_and_already_held_nothing_more():
    decision = decide(OFFICE, WindowState(replicas=0, held_action=WindowAction.PAUSE, remembered=3), OUT)
    assert (decision.move, decision.remember, decision.holds) == (WindowMove.NONE, 3, True)


def test_back_inside_pause_and_scale_restore_the_remembered_count():
    for action in (WindowAction.PAUSE, WindowAction.SCALE):
        held = WindowState(replicas=0 if action == WindowAction.PAUSE else 1, held_action=action, remembered=3)
        decision = decide(OFFICE, held, IN)
        assert (decision.move, decision.action, decision.replicas, decision.remember, decision.holds) == (
            WindowMove.RESTORE,
            action,
            3,
            None,
            False,
        )


def test_back_inside_stop_is_not_undone():
    stop = window([("09:00", "18:00")], action="stop")
    held = WindowState(replicas=0, held_action=WindowAction.STOP, stopped=True)
    decision = decide(stop, held, IN)
    assert (decision.move, decision.replicas, decision.holds) == (WindowMove.RELEASE, 0, False)
    assert decision.reason == "inside the window: stop is not undone"
    # and a stopped service is never acted on again
    assert decide(stop, WindowState(replicas=0, stopped=True), OUT).move == WindowMove.NONE


def test_inside_and_not_held_nothing():
    decision = decide(OFFICE, WindowState(replicas=2), IN)
    assert (decision.move, decision.holds) == (WindowMove.NONE, False)


def test_an_inactive_tenant_skips_a_scale_that_adds_replicas():
    scale_up = window([("09:00", "18:00")], action="scale", scale_to=5)
    decision = decide(scale_up, WindowState(replicas=2, tenant_active=False), OUT)
    assert (decision.move, decision.replicas, decision.holds) == (WindowMove.SKIP, 2, False)
    assert "would add replicas and the tenant is inactive" in decision.reason
    # the same tenant, active: applied
    assert decide(scale_up, WindowState(replicas=2), OUT).move == WindowMove.APPLY


def test_an_inactive_tenant_still_shrinks_and_pauses():
    scale_down = window([("09:00", "18:00")], action="scale", scale_to=1)
    assert decide(scale_down, WindowState(replicas=3, tenant_active=False), OUT).move == WindowMove.APPLY
    assert decide(OFFICE, WindowState(replicas=3, tenant_active=False), OUT).move == WindowMove.APPLY


def test_an_inactive_tenant_skips_a_restore_that_adds_replicas_and_stays_held():
    held = WindowState(replicas=0, held_action=WindowAction.PAUSE, remembered=3, tenant_active=False)
    decision = decide(OFFICE, held, IN)
    assert (decision.move, decision.replicas, decision.remember, decision.holds) == (WindowMove.SKIP, 0, 3, True)
    # a restore that shrinks (someone scaled up by hand during the hold) still happens
    bigger = WindowState(replicas=5, held_action=WindowAction.SCALE, remembered=3, tenant_active=False)
    assert decide(OFFICE, bigger, IN).replicas == 3


def test_a_changed_action_while_held_keeps_the_first_remembered_count():
    scale = window([("09:00", "18:00")], action="scale", scale_to=1)
    paused = WindowState(replicas=0, held_action=WindowAction.PAUSE, remembered=4)
    decision = decide(scale, paused, OUT)
    assert (decision.move, decision.action, decision.replicas, decision.remember) == (
        WindowMove.APPLY,
        WindowAction.SCALE,
        1,
        4,
    )


def test_a_held_scale_that_drifted_is_applied_again():
    scale = window([("09:00", "18:00")], action="scale", scale_to=1)
    drifted = WindowState(replicas=3, held_action=WindowAction.SCALE, remembered=4)
    decision = decide(scale, drifted, OUT)
    assert (decision.move, decision.replicas, decision.remember) == (WindowMove.APPLY, 1, 4)


def test_a_removed_window_releases_its_hold():
    decision = decide(None, WindowState(replicas=0, held_action=WindowAction.PAUSE, remembered=2), OUT)
    assert (decision.move, decision.replicas, decision.holds) == (WindowMove.RESTORE, 2, False)
    assert decide(None, WindowState(replicas=2), OUT).move == WindowMove.NONE


def test_a_sleeping_service_outside_is_left_to_sleep():
    decision = decide(OFFICE, WindowState(replicas=2, sleeping=True), OUT)
    assert (decision.move, decision.holds) == (WindowMove.NONE, False)


def test_the_job_at_the_exact_end_acts_and_one_second_before_does_not():
    end = utc(2026, 12, 1, 10, 0)  # Tue 18:00 Shanghai
    assert decide(OFFICE, WindowState(replicas=2), end - timedelta(seconds=1)).move == WindowMove.NONE
    assert decide(OFFICE, WindowState(replicas=2), end).move == WindowMove.APPLY


def test_a_range_whose_two_times_are_bad_names_both_and_nothing_else():
    errors = validate_window({**GOOD, "ranges": [{"start": "9", "end": "x"}]})
    assert errors == [
        "range 1 start must be a local time HH:MM (00:00–23:59), not '9'",
        "range 1 end must be a local time HH:MM (00:00–23:59, or 24:00), not 'x'",
    ]
