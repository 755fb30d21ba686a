"""A node's tunnel host key, pinned the first time the node registers it (through the
agent route, with the agent key): later registrations must offer the same key. A key
already pinned to another node is refused too (one key, one node: the tunnel process
names the node by its key)."""

from __future__ import annotations

from dataclasses import dataclass

import asyncssh

from apps.core.clock import utcnow
from apps.tunnel.keys import fingerprint

_PIN = """
INSERT INTO tunnel_host_keys (node_id, public_key, fingerprint, pinned_at, last_instance)
SELECT %s, %s, %s, %s, '' WHERE EXISTS (SELECT 1 FROM nodes WHERE id = %s)
ON CONFLICT DO NOTHING
"""


@dataclass(frozen=True)
class Pinned:
    ok: bool
    node_known: bool = True
    why: str = ""


def normal_key(offered) -> str | None:
    """The offered key in OpenSSH form ("ssh-ed25519 AAAA…", no comment), None when it
    is not an ed25519 public key."""
    if not isinstance(offered, str) or len(offered) > 1000:
        return None
    try:
        key = asyncssh.import_public_key(offered.strip())
    except (asyncssh.KeyImportError, ValueError):
        return None
    if key.get_algorithm() != "ssh-ed25519":
        return None
    return key.export_public_key().decode().split()[0] + " " + key.export_public_key().decode().split()[1]


async def pin(conn, node_id: str, public_key: str) -> Pinned:
    """Pin `public_key` (normal_key's form) for the node, or check it against the pinned one."""
    print_ = fingerprint(public_key)
    await conn.execute(_PIN, (node_id, public_key, print_, utcnow(), node_id))
    cursor = await conn.execute("SELECT public_key FROM tunnel_host_keys WHERE node_id = %s", (node_id,))
    row = await cursor.fetchone()
    if row is None:
        cursor = await conn.execute("SELECT 1 FROM nodes WHERE id = %s", (node_id,))
        if await cursor.fetchone() is None:
            return Pinned(
                False, node_known=False, why="The node is not registered yet: it registers with its first heartbeat."
            )
        return Pinned(False, why="This host key is pinned to another node.")
    if row[0] != public_key:
        return Pinned(
            False,
            why="Another tunnel host key is pinned for this node; an operator forgets it in the admin "
            "(tunnel host keys) if the node was reinstalled.",
        )
    return Pinned(True)
