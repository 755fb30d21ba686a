"""The energy accumulators, through the real heartbeat route and a real PostgreSQL: each
card's measured energy (the trapezoid of two measured power readings over the beat's real
interval, gaps left unfilled and counted), the node's CPU estimate, and the daily rollup.
The clock is the route's own (apps.core.clock.utcnow), moved with time_machine."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
import time_machine

from apps.nodes import heartbeat
from apps.nodes.energy import roll_up_energy
from apps.nodes.models import EnergyDaily, Gpu, Node
from tests.nodes.payloads import gpu_stat
from tests.nodes.payloads import heartbeat as payload

pytestmark = pytest.mark.django_db(transaction=True)

DAY = datetime(2026, 12, 1, tzinfo=UTC)
INTERVAL = 5
EPYC = {"cpu_model": "AMD EPYC 7763 64-Core Processor", "cpu_sockets": 2}  # 280 W per socket


def power(index: int, t: float) -> float:
    """A card's power at t seconds into the day: varies, so the trapezoid and a
    rectangle sum differ."""
    return round(300 + 100 * math.sin(2 * math.pi * t / 3600 + index) + 10 * index, 1)


def cpu_used(t: float) -> float:
    return round(20 + 60 * (t % 600) / 600, 2)


class Meter:
    """The rule the accumulators follow, computed here beat by beat: both ends measured
    and the beat's interval (server receipt times) at most three of the node's beats:
    energy += (previous + now) × interval / 7200 Wh; a reading measured after a gap adds
    the time since the previous measured reading to the gap seconds."""

    def __init__(self, max_span=3 * INTERVAL):
        self.max_span = max_span
        self.wh = 0.0
        self.gap = 0.0
        self.since = None
        self.at = None  # when the last measured reading was taken
        self.last = None  # that reading

    def beat(self, now: datetime, previous_beat: datetime | None, reading: float | None):
        if reading is None:
            return
        if self.at is not None:
            dt = (now - self.at).total_seconds()
            if self.at == previous_beat and dt <= self.max_span:
                self.wh += (self.last + reading) * dt / 7200
            else:
                self.gap += dt
        self.since = self.since or now
        self.at, self.last = now, reading


class Timeline:
    """Beats every `every` seconds over `span` seconds, with the gaps: the agent silent
    for 10 minutes, power unreadable on cards 0 and 1 for an hour, card 2 gone from
    `lost_from` on, card 3 never reading power."""

    def __init__(self, every, span, silent_from, unreadable_from, lost_from):
        self.every, self.span = every, span
        self.silent = (silent_from, silent_from + 600)
        self.unreadable = (unreadable_from, unreadable_from + 3600)
        self.lost_from = lost_from

    def beats(self):
        for t in range(0, self.span, self.every):
            if not self.silent[0] <= t < self.silent[1]:
                yield t

    def readings_at(self, t: int) -> dict[int, float | None]:
        readings = {}
        for index in (0, 1, 2, 3):
            if index == 2 and t >= self.lost_from:
                continue  # lost: not in gpu_stats at all
            unreadable = index in (0, 1) and self.unreadable[0] <= t < self.unreadable[1]
            readings[index] = None if unreadable or index == 3 else power(index, t)
        return readings


def beat_body(readings: dict[int, float | None], **overrides) -> dict:
    stats = []
    for index, watts in readings.items():
        stat = gpu_stat(index, power_w=watts)
        if watts is None:
            del stat["power_w"]
            stat["metrics_available"] = ["utilization", "memory_used_mb", "temperature"]
        stats.append(stat)
    return payload(gpus=0, gpu_stats=stats, gpu_capabilities={}, **overrides)


# The day with gaps, at the agent's 60 s interval, and two hours of it at the
# default 5 s (the same events, sooner). A whole day at 5 s is 17,280 beats through the
# route: minutes on the suite's shared database, for no rule the two runs do not test.
TIMELINES = {
    "a day at 60 s": Timeline(every=60, span=86_400, silent_from=7_200, unreadable_from=21_600, lost_from=43_200),
    "two hours at 5 s": Timeline(every=5, span=7_200, silent_from=600, unreadable_from=1_800, lost_from=5_400),
}


@pytest.mark.parametrize("name", TIMELINES)
def test_the_accumulators_over_a_day_with_gaps(agents, name):
    timeline = TIMELINES[name]
    node_id = "energy-" + name.replace(" ", "-")
    meters = {index: Meter(3 * timeline.every) for index in (0, 1, 2, 3)}
    cpu = Meter(3 * timeline.every)
    tdp = 2 * 280.0
    previous = None
    with time_machine.travel(DAY, tick=False) as clock:
        for t in timeline.beats():
            now = DAY + timedelta(seconds=t)
            clock.move_to(now)
            readings = timeline.readings_at(t)
            used = cpu_used(t)
            body = beat_body(readings, cpu_used=used, heartbeat_interval=timeline.every, **EPYC)
            response = agents.send(node_id, body)
            assert response.status_code == 200, response.text
            for index, meter in meters.items():
                meter.beat(now, previous, readings.get(index))
            cpu.beat(now, previous, tdp * (0.3 + 0.7 * used / 100))
            previous = now
            if t % 600 == 0:
                roll_up_energy(now=now)
        roll_up_energy(now=previous)

    cards = {gpu.index: gpu for gpu in Gpu.objects.filter(node_id=node_id)}
    for index in (0, 1, 2):
        card, meter = cards[index], meters[index]
        assert card.energy_wh == pytest.approx(meter.wh, rel=1e-12), index
        assert card.energy_gap_seconds == pytest.approx(meter.gap, abs=1e-6), index
        assert (card.energy_since, card.power_at) == (meter.since, meter.at), index
    # the gaps: the silent 10 minutes (and the interval into them) on every measured
    # card, the unreadable hour on cards 0 and 1; card 2's time since it was lost is not
    # a gap yet (no reading came after it) and holds no invented energy
    every = timeline.every
    assert meters[0].gap == meters[1].gap == (600 + every) + (3600 + every) and meters[2].gap == 600 + every
    assert cards[2].lost_at is not None
    assert cards[2].power_at == DAY + timedelta(seconds=timeline.lost_from - every)
    # the Meter against a plain sum: the trapezoid of every pair of consecutive beats
    # at which card 0's power was read
    read = {t: timeline.readings_at(t)[0] for t in timeline.beats()}
    pairs = [(t, t + every) for t in read if read[t] is not None and read.get(t + every) is not None]
    assert meters[0].wh == pytest.approx(sum((read[a] + read[b]) * every / 7200 for a, b in pairs), rel=1e-9)
    # a card whose power was never read: no energy, not "0 Wh measured since"
    assert (cards[3].energy_wh, cards[3].energy_since, cards[3].power_at, cards[3].energy_gap_seconds) == (
        0.0,
        None,
        None,
        0.0,
    )

    node = Node.objects.get(pk=node_id)
    assert node.cpu_tdp_w_model == tdp
    assert node.cpu_energy_wh_estimate == pytest.approx(cpu.wh, rel=1e-12)
    assert node.cpu_power_at == cpu.at == previous
    assert node.cpu_power_w_estimate == pytest.approx(tdp * (0.3 + 0.7 * cpu_used(timeline.span - every) / 100))

    # the rollup: the whole run on one UTC day, per card and for the CPU estimate
    daily = {row.gpu_index: row for row in EnergyDaily.objects.filter(node_id=node_id)}
    assert set(daily) == {EnergyDaily.CPU_ESTIMATE, 0, 1, 2}  # card 3 measured nothing
    assert {row.day for row in daily.values()} == {DAY.date()}
    for index in (0, 1, 2):
        assert daily[index].wh == pytest.approx(cards[index].energy_wh, rel=1e-9)
        assert daily[index].meter_wh == cards[index].energy_wh
    assert daily[EnergyDaily.CPU_ESTIMATE].wh == pytest.approx(node.cpu_energy_wh_estimate, rel=1e-9)


def beats(agents, node_id, start, count, body_at, every=INTERVAL):
    """`count` beats from `start`, every `every` seconds; body_at(k) is beat k's body."""
    with time_machine.travel(start, tick=False) as clock:
        for k in range(count):
            clock.move_to(start + timedelta(seconds=k * every))
            response = agents.send(node_id, body_at(k))
            assert response.status_code == 200, response.text


def test_a_collector_error_measures_nothing_and_a_longer_interval_is_a_gap(agents):
    node_id = "energy-skip"
    bodies = [
        beat_body({0: 200.0}),
        beat_body({0: 300.0}),  # +5 s: (200 + 300) / 2 × 5 s
        payload(gpus=0, gpu_stats=[], gpu_capabilities={}, gpu_collector_error="nvidia-smi: timed out"),
        beat_body({0: 400.0}),  # 10 s after the last reading, one beat (the error's) between
        beat_body({0: 500.0}),  # +5 s: counted again
        # an error beat that carries readings all the same: they are not measurements
        beat_body({0: 999.0}, gpu_collector_error="nvidia-smi: partial output"),
        beat_body({0: 500.0}),  # 10 s after the last measured reading: a gap again
    ]
    beats(agents, node_id, DAY, len(bodies), lambda k: bodies[k])
    card = Gpu.objects.get(node_id=node_id, index=0)
    assert card.energy_wh == pytest.approx((200 + 300) * 5 / 7200 + (400 + 500) * 5 / 7200, rel=1e-12)
    assert card.energy_gap_seconds == 20.0
    assert card.power_at == DAY + timedelta(seconds=30)
    assert card.lost_at is None and card.present_streak == 5  # the error beats judged nothing

    # the agent back after 16 s (more than three beats): a gap, whatever the readings
    with time_machine.travel(DAY + timedelta(seconds=30 + 16), tick=False):
        agents.send(node_id, beat_body({0: 500.0}))
    card.refresh_from_db()
    assert card.energy_gap_seconds == 36.0
    assert card.energy_wh == pytest.approx((200 + 300) * 5 / 7200 + (400 + 500) * 5 / 7200, rel=1e-12)
    # 15 s is still within three beats: integrated
    with time_machine.travel(DAY + timedelta(seconds=46 + 15), tick=False):
        agents.send(node_id, beat_body({0: 100.0}))
    card.refresh_from_db()
    assert card.energy_wh == pytest.approx((200 + 300 + 400 + 500) * 5 / 7200 + (500 + 100) * 15 / 7200, rel=1e-12)


def test_a_structural_change_keeps_the_interval(agents):
    """The slow path (a new agent version, a card gone) runs the same beat after the
    structure update, which leaves the previous beat's time for it to read."""
    node_id = "energy-slow"
    bodies = [
        beat_body({0: 100.0, 1: 100.0}),
        beat_body({0: 200.0, 1: 200.0}, agent_version="2.5.0"),
        beat_body({0: 300.0}, agent_version="2.5.0"),
    ]
    beats(agents, node_id, DAY, len(bodies), lambda k: bodies[k])
    first, second = Gpu.objects.filter(node_id=node_id).order_by("index")
    assert first.energy_wh == pytest.approx((100 + 200) * 5 / 7200 + (200 + 300) * 5 / 7200, rel=1e-12)
    assert second.energy_wh == pytest.approx((100 + 200) * 5 / 7200, rel=1e-12)
    assert first.energy_gap_seconds == second.energy_gap_seconds == 0.0


def test_the_cpu_estimate_with_and_without_a_tdp(agents, settings):
    node_id = "energy-cpu"
    # no CPU model the table knows, no operator's TDP: no estimate at all
    beats(agents, node_id, DAY, 2, lambda k: beat_body({}, cpu_used=50.0, cpu_model="Unknown CPU", cpu_sockets=1))
    node = Node.objects.get(pk=node_id)
    assert (node.cpu_tdp_w_model, node.cpu_power_w_estimate, node.cpu_power_at) == (None, None, None)
    assert node.cpu_energy_wh_estimate == 0.0

    # the operator's TDP for the node; the idle share from the settings
    Node.objects.filter(pk=node_id).update(cpu_tdp_w=400.0)
    settings.HETEROFLOW_CPU_IDLE_POWER_FRACTION = 0.25
    used = [40.0, 80.0, None, 60.0, 20.0]

    def body(k):
        extra = {"cpu_model": "Unknown CPU", "cpu_sockets": 1}
        if used[k] is not None:
            extra["cpu_used"] = used[k]
        body = beat_body({}, **extra)
        if used[k] is None:
            del body["cpu_used"]
        return body

    start = DAY + timedelta(minutes=1)
    beats(agents, node_id, start, len(used), body)
    node.refresh_from_db()

    def watts(u):
        return 400.0 * (0.25 + 0.75 * u / 100)

    # 40 → 80 integrated; cpu_used missing: no estimate (null), so neither interval around
    # it counts; 60 → 20 integrated
    assert node.cpu_energy_wh_estimate == pytest.approx(
        (watts(40) + watts(80)) * 5 / 7200 + (watts(60) + watts(20)) * 5 / 7200, rel=1e-12
    )
    assert node.cpu_power_w_estimate == pytest.approx(watts(20))
    assert node.cpu_power_at == start + timedelta(seconds=20)

    # the model table, from the agent's CPU facts (slow path: they are structural)
    Node.objects.filter(pk=node_id).update(cpu_tdp_w=None)
    later = DAY + timedelta(minutes=5)
    with time_machine.travel(later, tick=False):
        agents.send(node_id, beat_body({}, cpu_used=0.0, **EPYC))
    node.refresh_from_db()
    assert (node.cpu_model, node.cpu_sockets, node.cpu_tdp_w_model) == (EPYC["cpu_model"], 2, 560.0)
    assert node.cpu_power_w_estimate == pytest.approx(560.0 * 0.25)


def test_the_rollup_across_a_utc_midnight(agents):
    node_id = "energy-midnight"
    start = DAY - timedelta(minutes=10)  # 23:50 on the day before

    def body(k):
        return beat_body({0: 360.0}, cpu_used=50.0, **EPYC)

    with time_machine.travel(start, tick=False) as clock:
        for k in range(241):  # 23:50 → 00:10, every 5 s
            now = start + timedelta(seconds=5 * k)
            clock.move_to(now)
            assert agents.send(node_id, body(k)).status_code == 200
            if now.minute % 5 == 0 and now.second == 0 and k:
                roll_up_energy(now=now)
    card = Gpu.objects.get(node_id=node_id, index=0)
    assert card.energy_wh == pytest.approx(360.0 * 1200 / 3600, rel=1e-12)  # 20 min at 360 W: 120 Wh
    rows = {(row.day, row.gpu_index): row.wh for row in EnergyDaily.objects.filter(node_id=node_id)}
    before, after = (DAY - timedelta(days=1)).date(), DAY.date()
    # the rollups at 23:55 and 00:00 (the latter's 5 minutes land on the new day) …
    assert rows[(before, 0)] == pytest.approx(30.0, rel=1e-9)  # 23:50 → 23:55
    assert rows[(after, 0)] == pytest.approx(90.0, rel=1e-9)  # 23:55 → 00:10
    cpu_watts = 560.0 * (0.3 + 0.7 * 0.5)
    assert rows[(before, EnergyDaily.CPU_ESTIMATE)] == pytest.approx(cpu_watts * 300 / 3600, rel=1e-9)
    assert rows[(before, EnergyDaily.CPU_ESTIMATE)] + rows[(after, EnergyDaily.CPU_ESTIMATE)] == pytest.approx(
        cpu_watts * 1200 / 3600, rel=1e-9
    )
    # a second run at once changes nothing
    assert roll_up_energy(now=DAY + timedelta(minutes=10))["rows"] == 0


def test_a_recreated_card_starts_the_rollup_over_never_negative(agents):
    node_id = "energy-recreated"
    beats(agents, node_id, DAY, 3, lambda k: beat_body({0: 720.0}))  # 10 s at 720 W: 2 Wh
    roll_up_energy(now=DAY + timedelta(seconds=10))
    assert EnergyDaily.objects.get(node_id=node_id, gpu_index=0).wh == pytest.approx(2.0)
    # the card row removed (an operator's clean-up) and registered again by the next beats
    Gpu.objects.filter(node_id=node_id).delete()
    Node.objects.filter(pk=node_id).update(structure_hash="")
    beats(agents, node_id, DAY + timedelta(minutes=1), 2, lambda k: beat_body({0: 360.0}))  # 5 s: 0.5 Wh
    assert Gpu.objects.get(node_id=node_id, index=0).energy_wh == pytest.approx(0.5)
    roll_up_energy(now=DAY + timedelta(minutes=2))
    row = EnergyDaily.objects.get(node_id=node_id, gpu_index=0)
    assert row.wh == pytest.approx(2.5) and row.meter_wh == pytest.approx(0.5)


@pytest.mark.parametrize(
    "model,sockets,tdp",
    [
        ("Intel(R) Xeon(R) Platinum 8480+", 2, 700.0),
        ("Intel(R) Xeon(R) Gold 6248R CPU @ 3.00GHz", 2, 410.0),
        ("Intel(R) Xeon(R) Platinum 8380 CPU @ 2.30GHz", 1, 270.0),
        ("Intel(R) Xeon(R) 6980P", 2, 1000.0),
        ("AMD EPYC 7H12 64-Core Processor", 2, 560.0),
        ("AMD EPYC 9654 96-Core Processor", 1, 360.0),
        ("AMD EPYC 9684X 96-Core Processor", 2, 800.0),
        ("Kunpeng 920-6426", 2, 360.0),
        ("HUAWEI Kunpeng 920 4826", 4, 600.0),
        ("Hygon C86 7185 32-core Processor", 2, 360.0),
        # not in the table, or the sockets unknown: no model TDP
        ("Intel(R) Xeon(R) CPU E5-2680 v4 @ 2.40GHz", 2, None),
        ("Kunpeng 920 7270Z To be filled by O.E.M. CPU @ 2.9GHz", 2, None),
        ("AMD EPYC 7763 64-Core Processor", None, None),
        ("", 1, None),
    ],
)
def test_the_cpu_model_table(model, sockets, tdp):
    from apps.nodes.energy import cpu_tdp_w_model

    assert cpu_tdp_w_model(model, sockets) == tdp


def test_the_cpu_facts_change_the_structure_hash_only_when_sent():
    older = payload()
    # the hash an agent without the CPU facts has always had (computed before they existed)
    assert heartbeat.structure_hash(older) == OLDER_AGENTS_HASH
    assert heartbeat.structure_hash(older | EPYC) != OLDER_AGENTS_HASH
    assert heartbeat.structure_hash(older | EPYC) != heartbeat.structure_hash(older | EPYC | {"cpu_sockets": 1})


OLDER_AGENTS_HASH = "fee4c0d81f6557fb84e89aa604c72ab6"
