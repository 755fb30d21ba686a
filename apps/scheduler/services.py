"""The scheduler's shell, as its callers have always imported it: the names of the modules
it is made of, re-exported. Each concern has its own module (import from there in new
code):

- `plugins`: the plugins, their effective table and options, the sharing rule;
- `snapshot`: the fleet in a few raw queries, and the GPU rows a process reuses;
- `queue`: the single tasks' batch, the groups' window, a request as the queue sees it;
- `reservations`: a waiting group's reservation, stored cycle by cycle;
- `bind`: a cycle's decisions bound in one transaction;
- `preemption`: victims moved to preempting, and the watchdog;
- `cycle`: one cycle, and a dry run.
"""

from apps.scheduler.bind import (
    EXPLAIN,
    GROUPS_BOUND,
    INFERENCE_PORTS,
    PORTS_IN_USE,
    assign_host_ports,
    bind_all,
    bind_rows,
    explain_refusals,
    ports_wanted,
)
from apps.scheduler.cycle import (
    EXPLAIN_GROUPS,
    CycleResult,
    PhaseClock,
    dry_run,
    explain_now,
    run_cycle,
)
from apps.scheduler.load import (
    THRESHOLD_FIELDS,
)
from apps.scheduler.plugins import (
    EXTRA_OPTIONS,
    PLUGINS,
    PluginSpec,
    checked_extra,
    plugin_settings,
    plugin_table,
    set_plugin_enabled,
    set_plugin_options,
    sharing_rule,
)
from apps.scheduler.preemption import (
    OCCUPANTS_SQL,
    PREEMPTION_GRACE,
    PREEMPTION_TRIGGERS,
    force_overdue_preemptions,
    load_occupants,
    preempt_for,
)
from apps.scheduler.queue import (
    AFTER_CURSOR,
    BATCH_SIZE,
    GROUP_BATCH_SIZE,
    GROUP_CURSOR_ROW,
    MOVE_CURSOR,
    QUEUE_SQL,
    QUEUE_STATE,
    REPLICAS_ON_NODES,
    SINGLE_SQL,
    WAITING_GROUPS_SQL,
    GroupWindow,
    group_window,
    next_batch,
    next_batch_ordered,
    pending_request,
    queue_state,
    replicas_on_nodes,
    waiting_group,
)
from apps.scheduler.reservations import (
    STORE_RESERVATIONS,
    head_since,
    reservation_reports,
    reserving_groups,
    standing_reservations,
    store_reservations,
)
from apps.scheduler.snapshot import (
    GPUS_SQL,
    HOLDERS_SQL,
    LIVE_SLICES_SQL,
    NODES_SQL,
    PORTS_USED,
    UNHELD_SLICES,
    GpuRowCache,
    GpuRows,
    card_at,
    load_nodes,
    read_gpu_rows,
)

__all__ = [
    "AFTER_CURSOR",
    "BATCH_SIZE",
    "CycleResult",
    "EXPLAIN",
    "EXPLAIN_GROUPS",
    "EXTRA_OPTIONS",
    "GPUS_SQL",
    "GROUPS_BOUND",
    "GROUP_BATCH_SIZE",
    "GROUP_CURSOR_ROW",
    "GpuRowCache",
    "GpuRows",
    "GroupWindow",
    "HOLDERS_SQL",
    "INFERENCE_PORTS",
    "LIVE_SLICES_SQL",
    "MOVE_CURSOR",
    "NODES_SQL",
    "OCCUPANTS_SQL",
    "PLUGINS",
    "PORTS_IN_USE",
    "PORTS_USED",
    "PREEMPTION_GRACE",
    "PREEMPTION_TRIGGERS",
    "PhaseClock",
    "PluginSpec",
    "QUEUE_SQL",
    "QUEUE_STATE",
    "REPLICAS_ON_NODES",
    "SINGLE_SQL",
    "STORE_RESERVATIONS",
    "THRESHOLD_FIELDS",
    "UNHELD_SLICES",
    "WAITING_GROUPS_SQL",
    "assign_host_ports",
    "bind_all",
    "bind_rows",
    "card_at",
    "checked_extra",
    "dry_run",
    "explain_now",
    "explain_refusals",
    "force_overdue_preemptions",
    "group_window",
    "head_since",
    "load_nodes",
    "load_occupants",
    "next_batch",
    "next_batch_ordered",
    "pending_request",
    "plugin_settings",
    "plugin_table",
    "ports_wanted",
    "preempt_for",
    "queue_state",
    "read_gpu_rows",
    "replicas_on_nodes",
    "reservation_reports",
    "reserving_groups",
    "run_cycle",
    "set_plugin_enabled",
    "set_plugin_options",
    "sharing_rule",
    "standing_reservations",
    "store_reservations",
    "waiting_group",
]
