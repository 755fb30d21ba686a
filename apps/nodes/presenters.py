"""Nodes as the API shows them. PostgreSQL builds the JSON of a whole page in one query
(nodes, their GPUs, lost counts and GPU usage) and the response embeds it as is: a page
of 100 nodes with 8 GPUs each is ~1,000 objects, far too many to build field by field
in Python on a hot page. api/serializers.NodeSerializer describes the same shape for the
OpenAPI schema, from these same field lists."""

from __future__ import annotations

import orjson
from django.db import connection

from apps.nodes.choices import CardIdentity
from apps.nodes.gpu_health_selectors import health_summary_sql
from apps.nodes.gpu_state import state_sql
from apps.tasks.choices import ACTIVE

NODE_COLUMNS = [
    "id",
    "name",
    "status",
    "ip",
    "internal_ip",
    "internal_prefix",
    "mac",
    "hostname",
    "os",
    "cpu_cores",
    "memory_gb",
    "is_container",
    "docker_available",
    "executable",
    "exec_mode",
    "error_message",
    "agent_version",
    "agent_git_commit",
    "agent_build_time",
    "heartbeat_interval",
    "cpu_used",
    "memory_used",
    "gpu_temperature",
    "gpu_memory_used_mb",
    "gpu_type",
    "gpu_model",
    "gpu_count",
    "gpu_collector_error",
    "labels",
    "gpu_capabilities",
    "inference_engines",
    "inference_engine_versions",
    "vllm_available",
    "discovered_models",
    "task_health",
    "live_task_ids",
    "region",
    "zone",
    "rack",
    "version",
    "registered_at",
    "last_heartbeat_at",
]
NODE_COMPUTED = ["tenant", "gpu_used", "gpus_lost", "gpus_lost_unidentified", "gpu_loss_note", "gpus"]
GPU_COLUMNS = [
    "index",
    "uuid",
    "vendor",
    "model",
    "memory_total_mb",
    "compute_capability",
    "pci_bus_id",
    "matched_by",
    "reported_index",
    "utilization",
    "memory_used_mb",
    "temperature",
    "power_w",
    "metrics_available",
    "lost_at",
    "lost_basis",
    "cordoned_at",
    "cordon_source",
    "cordon_reason",
]
# state: apps.nodes.gpu_state's rule, in SQL; cordoned: cordoned_at is set; health: the
# card's health summary (apps.nodes.gpu_health_selectors.health_summary_sql)
GPU_COMPUTED = ["state", "cordoned", "health"]

TIMESTAMP_COLUMNS = {"registered_at", "last_heartbeat_at", "lost_at", "cordoned_at"}


def _timestamp(expression: str) -> str:
    """A timestamp in the API's one format (UTC, 'Z')."""
    return f"""to_char({expression} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"""


def _select(alias: str, column: str) -> str:
    """A column for the JSON; timestamps in the API's one format."""
    if column in TIMESTAMP_COLUMNS:
        return f"{_timestamp(f'{alias}.{column}')} AS {column}"
    return f"{alias}.{column}"


# What a node says when cards known only by their position are lost (apps.nodes.card_identity):
# the lost rows are the positions that went missing, not necessarily the cards that failed.
LOSS_NOTE = (
    "CASE WHEN COALESCE(g.lost_unidentified, 0) = 0 THEN '' "
    "WHEN g.lost_unidentified = 1 THEN 'A GPU of this node is lost, and which one cannot be told' "
    "ELSE g.lost_unidentified || ' GPUs of this node are lost, and which ones cannot be told' END "
    "|| CASE WHEN COALESCE(g.lost_unidentified, 0) = 0 THEN '' ELSE ': its tool renumbers the cards after one "
    "drops out and prints no UUID or PCI address, so the lost index is the position that went missing, not "
    "necessarily the card that failed.' END"
)

# Built with the text `json` functions (several times faster than jsonb for output).
# {source} is a relation of (id, ord): the nodes to show, in order.
PAGE_JSON = f"""
SELECT COALESCE(json_agg(page.doc ORDER BY page.ord), '[]'::json)::text
FROM (
    SELECT p.ord, row_to_json(d) AS doc
    FROM {{source}} AS p(id, ord)
    JOIN LATERAL (
        SELECT {", ".join(_select("n", c) for c in NODE_COLUMNS)}, t.slug AS tenant,
               COALESCE(u.used, 0) AS gpu_used, COALESCE(g.lost, 0) AS gpus_lost,
               COALESCE(g.lost_unidentified, 0) AS gpus_lost_unidentified, {LOSS_NOTE} AS gpu_loss_note,
               COALESCE(g.gpus, '[]'::json) AS gpus
        FROM nodes AS n
        LEFT JOIN tenants AS t ON t.id = n.tenant_id
        LEFT JOIN LATERAL (
            SELECT json_agg(row_to_json(x) ORDER BY x.index) AS gpus, count(*) FILTER (WHERE x.state = 'lost') AS lost,
                   count(*) FILTER (WHERE x.state = 'lost' AND x.matched_by = '{CardIdentity.POSITION}')
                       AS lost_unidentified
            FROM (
                SELECT {", ".join(_select("gpus", c) for c in GPU_COLUMNS)}, {state_sql("gpus")} AS state,
                       gpus.cordoned_at IS NOT NULL AS cordoned, {health_summary_sql("gpus", _timestamp)} AS health
                FROM gpus WHERE gpus.node_id = n.id
            ) AS x
        ) AS g ON true
        LEFT JOIN LATERAL (
            SELECT sum(tasks.gpu_required) AS used FROM tasks WHERE tasks.node_id = n.id AND tasks.status = ANY(%s)
        ) AS u ON true
        WHERE n.id = p.id
    ) AS d ON true
) AS page
"""
BY_IDS = PAGE_JSON.format(source="unnest(%s::text[]) WITH ORDINALITY")
# One round trip for a list page: how many match, and the page itself.
LIST_PAGE = """
SELECT (SELECT count(*) FROM ({matching}) AS everything),
       ({page})
"""


def _page_text(node_ids) -> str:
    with connection.cursor() as cursor:
        cursor.execute(BY_IDS, [list(node_ids), list(ACTIVE)])
        return cursor.fetchone()[0]


def present_page(nodes, order: tuple[str, ...], *, limit: int, offset: int) -> tuple[int, orjson.Fragment]:
    """`nodes`: a queryset of the nodes that match. Returns how many match and the JSON
    of the page [offset, offset + limit) in `order`, in one statement (the page's ids
    come from the ordering index, not from sorting every match)."""
    matching, matching_params = nodes.order_by().values("id").query.sql_with_params()
    ordered, ordered_params = nodes.order_by(*order).values("id")[offset : offset + limit].query.sql_with_params()
    page = PAGE_JSON.format(source=f"(SELECT q.id, row_number() OVER () FROM ({ordered}) AS q)")
    with connection.cursor() as cursor:
        cursor.execute(
            LIST_PAGE.format(matching=matching, page=page), [*matching_params, *ordered_params, list(ACTIVE)]
        )
        count, text = cursor.fetchone()
    return count, orjson.Fragment(text)


def present_one(node) -> dict:
    return orjson.loads(_page_text([node.pk]))[0]
