"""The load thresholds: the one rule for when a node or a card is too loaded to take new
work (docs/scheduler.md, the resource-filter plugin).

A node at or above its CPU or memory threshold takes nothing new; a card at or above its
memory, utilisation or temperature threshold takes nothing new. A reading the agent did
not send is no load, and a card's memory is judged only when its total is known.

The rule exists twice: in Python for one node or card (the core's filters, on the
snapshot), and in SQL for a set of rows in one statement (bind's re-check of the rows as
they are now, under the node locks). Both are written here, side by side;
tests/scheduler/test_load.py checks on a grid of readings and thresholds that they agree.
Like the core that reads it, this module imports no Django: the SQL is text.
"""

from __future__ import annotations

# The thresholds, fields of the core's PluginSettings (configurable as the
# resource-filter plugin's `extra`), each with the reading it bounds.
THRESHOLD_FIELDS = (
    "cpu_percent_max",
    "memory_percent_max",
    "gpu_memory_percent_max",
    "gpu_utilization_max",
    "gpu_temperature_max",
)


# --- one node or card ------------------------------------------------------------------


def overloaded(node, settings) -> bool:
    """At or above the node's CPU or memory threshold. NODE_OVERLOADED_SQL is the same."""
    return (node.cpu_used is not None and node.cpu_used >= settings.cpu_percent_max) or (
        node.memory_used is not None and node.memory_used >= settings.memory_percent_max
    )


def card_under_load(gpu, settings) -> bool:
    """Below the card's memory, utilisation and temperature thresholds. CARD_UNDER_LOAD_SQL
    is the same."""
    if gpu.memory_total_mb and gpu.memory_used_mb is not None:
        if gpu.memory_used_mb * 100 >= gpu.memory_total_mb * settings.gpu_memory_percent_max:
            return False
    if gpu.utilization is not None and gpu.utilization >= settings.gpu_utilization_max:
        return False
    return gpu.temperature is None or gpu.temperature < settings.gpu_temperature_max


# --- a set of rows, in SQL ---------------------------------------------------------------

# `overloaded` over a `nodes` row, with the named parameters of load_params(settings). A
# NULL reading compares as NULL: coalesce makes it "not above".
NODE_OVERLOADED_SQL = """(
    coalesce(cpu_used >= %(cpu_percent_max)s::float8, false)
    OR coalesce(memory_used >= %(memory_percent_max)s::float8, false)
)"""
# `card_under_load` over a `gpus` row (memory_used_mb * 100 against total * percent, as in
# Python: the same floating-point products on both sides).
CARD_UNDER_LOAD_SQL = """(
    NOT coalesce(memory_total_mb <> 0
        AND memory_used_mb * 100 >= memory_total_mb * %(gpu_memory_percent_max)s::float8, false)
    AND NOT coalesce(utilization >= %(gpu_utilization_max)s::float8, false)
    AND coalesce(temperature < %(gpu_temperature_max)s::float8, true)
)"""


def load_params(settings) -> dict[str, float]:
    """The named parameters NODE_OVERLOADED_SQL and CARD_UNDER_LOAD_SQL take."""
    return {name: getattr(settings, name) for name in THRESHOLD_FIELDS}
