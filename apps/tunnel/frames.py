"""The exec session's frames, the same on the user's WebSocket (one frame a message:
a type byte, then the payload) and on the relay between a web process and the tunnel
process (a type byte, a 4-byte big-endian length, the payload). docs/tunnel.md#protocol.
The client (heteroflow_client.tunnel) spells the same numbers."""

from __future__ import annotations

import struct

STDIN, STDOUT, STDERR, RESIZE, EOF, EXIT = 0, 1, 2, 3, 4, 5  # RESIZE: JSON [cols, rows]; EXIT: JSON {"status"}
HEADER = struct.Struct(">BI")
MAX_FRAME = 1 << 20


def pack(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


async def read(reader) -> tuple[int, bytes] | None:
    """The next frame from an asyncio stream; None at its end."""
    try:  # asyncio.IncompleteReadError (cut mid-frame) is an EOFError
        kind, size = HEADER.unpack(await reader.readexactly(HEADER.size))
        if size > MAX_FRAME:
            return None
        return kind, await reader.readexactly(size)
    except (EOFError, ConnectionError, OSError):
        return None
