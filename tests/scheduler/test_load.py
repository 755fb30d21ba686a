"""The one load rule (apps/scheduler/load.py): its Python half (the core's filters) and its
SQL half (bind's re-check under the node locks) agree on a grid of readings around every
threshold, on the real PostgreSQL, and nothing else compares a reading with a threshold."""

import re
from dataclasses import replace
from itertools import product
from pathlib import Path

import pytest
from django.db import connection

from apps.nodes.models import Gpu, Node
from apps.scheduler import load
from apps.scheduler.bind import LiveCards
from apps.scheduler.core import PluginSettings

pytestmark = pytest.mark.django_db

# the defaults, and thresholds whose products are not exact in binary floating point
SETTINGS = (
    PluginSettings(),
    replace(
        PluginSettings(),
        cpu_percent_max=33.3,
        memory_percent_max=66.7,
        gpu_memory_percent_max=33.3,
        gpu_utilization_max=12.5,
        gpu_temperature_max=45.5,
    ),
)
TOTALS = (None, 0, 3, 1000, 81920, 143771)


def around(threshold: float, step: float) -> list[float | None]:
    return [None, 0.0, threshold - step, threshold, threshold + step, 100.0]


def memory_used(total: int | None, percent: float) -> list[int | None]:
    """No reading, none used, a hair under, at and over the threshold, all of it."""
    if not total:
        return [None, 0, 10]
    edge = round(total * percent / 100)
    return [None, 0, edge - 1, edge, edge + 1, total]


def seed(settings: PluginSettings) -> tuple[list[Node], list[Gpu]]:
    nodes = [
        Node(id=f"n{number}", name=f"n{number}", status="online", executable=True, cpu_used=cpu, memory_used=memory)
        for number, (cpu, memory) in enumerate(
            product(around(settings.cpu_percent_max, 0.001), around(settings.memory_percent_max, 0.001))
        )
    ]
    Node.objects.bulk_create([*nodes, Node(id="cards", name="cards", status="online", executable=True)])
    readings = [
        (total, used, utilization, temperature)
        for total in TOTALS
        for used in memory_used(total, settings.gpu_memory_percent_max)
        for utilization in around(settings.gpu_utilization_max, 0.5)[:5]
        for temperature in around(settings.gpu_temperature_max, 0.5)[:5]
    ]
    cards = [
        Gpu(
            node_id="cards",
            index=index,
            vendor="nvidia",
            memory_total_mb=total,
            memory_used_mb=used,
            utilization=utilization,
            temperature=temperature,
        )
        for index, (total, used, utilization, temperature) in enumerate(readings)
    ]
    Gpu.objects.bulk_create(cards)
    return nodes, cards


@pytest.mark.parametrize("settings", SETTINGS, ids=["defaults", "odd"])
def test_python_and_sql_agree_on_a_grid_of_readings(settings):
    nodes, cards = seed(settings)
    overloaded = {node.pk for node in nodes if load.overloaded(node, settings)}
    under_load = {card.index for card in cards if load.card_under_load(card, settings)}
    assert overloaded and len(overloaded) < len(nodes)  # the grid spans both answers
    assert under_load and len(under_load) < len(cards)

    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id FROM nodes WHERE {load.NODE_OVERLOADED_SQL}", load.load_params(settings))
        assert {node_id for (node_id,) in cursor.fetchall()} == overloaded
        cursor.execute(f"SELECT index FROM gpus WHERE {load.CARD_UNDER_LOAD_SQL}", load.load_params(settings))
        assert {index for (index,) in cursor.fetchall()} == under_load

    # and bind's own read, under the node locks
    live = LiveCards.read([node.pk for node in nodes] + ["cards"], settings)
    assert live.alive == {node.pk for node in nodes} - overloaded | {"cards"}
    assert live.usable == {("cards", index) for index in under_load}


REPO = Path(__file__).resolve().parents[2]
COMPARED = re.compile(r"\.(" + "|".join(load.THRESHOLD_FIELDS) + r")\b")


def test_only_the_load_module_compares_readings_with_the_thresholds():
    readers = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "apps").rglob("*.py")
        if path.name != "load.py" and COMPARED.search(re.sub(r"#.*|\"\"\"[\s\S]*?\"\"\"", "", path.read_text()))
    )
    assert readers == []
