"""The heartbeat's structural facts (what a beat says about the node and its cards rather
than their state: a change of any takes the slow path) are one table each in
apps/nodes/heartbeat.py, NODE_FACTS, CPU_FACTS and CARD_FACTS; the hashed keys, the
columns the slow path writes and the cards' upsert are derived from them."""

import ast
import copy

import pytest

from apps.nodes import heartbeat
from tests.nodes.payloads import heartbeat as payload
from tests.spelling import name_of, sources, tree

FACTS = {fact.key for fact in heartbeat.NODE_FACTS + heartbeat.CPU_FACTS}
CARD_FACTS = {fact.key for fact in heartbeat.CARD_FACTS}
# They list every column of a node or a card, to show them, structural or not.
SHOWN = {"apps/nodes/presenters.py", "apps/nodes/admin.py", "apps/nodes/gpu_health_selectors.py"}
# The columns a rule reads, which the scheduler loads for it and nothing more (the
# network domain: addresses, host and labels), structural or not.
READ = {"apps/nodes/network.py"}


def changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, "x"]
    return {**value, "x": "y"}


@pytest.mark.parametrize("key", sorted(FACTS))
def test_a_change_of_any_fact_takes_the_slow_path(key):
    beat = payload(cpu_model="AMD EPYC 9654 96-Core Processor", cpu_sockets=1)
    other = copy.deepcopy(beat)
    other[key] = changed(beat[key])
    assert heartbeat.structure_hash(other) != heartbeat.structure_hash(beat)


@pytest.mark.parametrize("key", sorted(CARD_FACTS))
def test_a_change_of_any_card_fact_takes_the_slow_path(key):
    beat = payload(gpus=2)
    for stat in beat["gpu_stats"]:  # a newer agent's card fact
        stat["pci_bus_id"] = f"0000:{stat['index'] + 16:02x}:00.0"
    other = copy.deepcopy(beat)
    other["gpu_stats"][1][key] = 7 if key == "index" else changed(beat["gpu_stats"][1][key])
    assert heartbeat.structure_hash(other) != heartbeat.structure_hash(beat)


def test_a_reading_keeps_the_steady_path():
    beat = payload(gpus=2)
    other = copy.deepcopy(beat) | {"cpu_used": 99.0, "live_task_ids": [4], "heartbeat_interval": 10}
    other["gpu_stats"][0] |= {"utilization": 1.0, "power_w": 1.0, "temperature": 1.0, "memory_used_mb": 1}
    assert heartbeat.structure_hash(other) == heartbeat.structure_hash(beat)


def test_the_slow_path_writes_every_fact_and_what_it_derives():
    params = heartbeat.structure_params(payload(gpus=2))
    written = set(heartbeat.STRUCTURE_COLUMNS) - {"structure_hash"}  # the beat's own parameter
    assert set(params) == written | set(heartbeat.MERGED_COLUMNS) | {"gpus", "reported"}
    assert FACTS <= set(heartbeat.NODE_INSERT_COLUMNS)
    assert all(f"u.{key}" in heartbeat.GPU_UPSERT for key in CARD_FACTS)


def fact_lists(module: ast.Module, name: str) -> list[str]:
    """A tuple, list, set or dict that spells three facts or more (four of a card's)."""
    found = []
    for node in ast.walk(module):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = node.keys
        else:
            continue
        spelled = {item.value for item in items if isinstance(item, ast.Constant)}
        if len(spelled & FACTS) >= 3 or len(spelled & CARD_FACTS) >= 4:
            found.append(f"{name}:{node.lineno}")
    return found


def test_no_other_list_of_the_facts():
    copies = [
        copy
        for path in sources()
        if name_of(path).startswith("apps/nodes/") and name_of(path) not in SHOWN | READ
        for copy in fact_lists(tree(path), name_of(path))
    ]
    assert copies == []


def test_the_check_sees_a_list():
    assert fact_lists(ast.parse('KEYS = ("hostname", "os", "mac")\nGPU = {"index": 1, "uuid": 2}'), "m.py") == [
        "m.py:1"
    ]
