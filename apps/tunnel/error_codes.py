"""The tunnel's error codes (docs/api.md#tunnel)."""

from __future__ import annotations

from enum import StrEnum


class TunnelErrorCode(StrEnum):
    HOST_KEY_MISMATCH = "host_key_mismatch"  # the node's pinned tunnel host key is another one
    NODE_UNKNOWN = "node_unknown"  # a node registers its tunnel before its first heartbeat
    TASK_NOT_RUNNING = "task_not_running"  # the task is not running: no way into it
    NODE_UNREACHABLE = "node_unreachable"  # no instance holds a tunnel to the task's node
    REFUSED_BY_NODE = "refused_by_node"  # the agent refused the channel (not its task's port...)
