"""The sessions' audit rows (TunnelSession), written by the tunnel process with raw SQL
on its own connection pool: a row when a session is asked for, its end (bytes each way,
how it ended) when it is over. Off the ORM, as every tunnel path is."""

from __future__ import annotations

from apps.core.clock import utcnow
from apps.tunnel.choices import SessionOutcome

_START = """
INSERT INTO tunnel_sessions
  (task_id, node_id, tenant_id, user_id, principal, kind, port, command, started_at,
   bytes_in, bytes_out, outcome, reason, instance)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, 0, 0, %s, %s, %s)
RETURNING id
"""
_END = """
UPDATE tunnel_sessions SET ended_at = %s, bytes_in = %s, bytes_out = %s, outcome = %s, reason = %s
WHERE id = %s
"""


async def start(pool, header: dict, instance: str, outcome: str = SessionOutcome.OPEN, reason: str = "") -> int:
    who = header.get("who") or {}
    async with pool.connection() as conn:
        cursor = await conn.execute(
            _START,
            (
                int(header.get("task") or 0),
                str(header.get("node") or ""),
                who.get("tenant_id"),
                who.get("user_id"),
                str(who.get("principal") or "unknown")[:300],
                header.get("kind") or "",
                header.get("port"),
                " ".join(header.get("argv") or ())[:4000],
                utcnow(),
                outcome,
                reason[:2000],
                instance[:200],
            ),
        )
        return (await cursor.fetchone())[0]


async def end(pool, session_id: int, bytes_in: int, bytes_out: int, outcome: str, reason: str = "") -> None:
    async with pool.connection() as conn:
        await conn.execute(_END, (utcnow(), bytes_in, bytes_out, outcome, reason[:2000], session_id))


async def node_connected(pool, node_id: str, instance: str) -> None:
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE tunnel_host_keys SET last_connected_at = %s, last_instance = %s WHERE node_id = %s",
            (utcnow(), instance[:200], node_id),
        )


async def node_of_key(pool, fingerprint: str) -> str | None:
    async with pool.connection() as conn:
        cursor = await conn.execute("SELECT node_id FROM tunnel_host_keys WHERE fingerprint = %s", (fingerprint,))
        row = await cursor.fetchone()
        return row[0] if row else None
