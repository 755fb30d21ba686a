"""heteroflow_client: the Python SDK of HeteroFlow (docs/sdk.md), and `hf`, its command line.

    from heteroflow_client import Client

    hf = Client()                      # HETEROFLOW_URL / HETEROFLOW_API_KEY, or `hf login`'s profile
    task = hf.run(["python", "train.py"], image="registry.local/trainer:1", gpus=1)
    for line in hf.logs(task):         # follows until the task ends
        print(line.text)

Names are imported on first use, so `import heteroflow_client` (and `hf --version`) stays
fast: httpx, PyYAML and jsonschema load only when a request is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from heteroflow_client._version import __version__
from heteroflow_client.errors import (
    ApiError,
    AuthError,
    ConnectionFailed,
    HeteroFlowError,
    NotFound,
    TaskFailed,
    ValidationError,
)

if TYPE_CHECKING:  # pragma: no cover
    from heteroflow_client.client import Client, LogStream
    from heteroflow_client.types import EndpointKey, LogEnd, LogLine, Me, Model, Node, Service, Task, TaskGroup

_LAZY = {
    "Client": "heteroflow_client.client",
    "LogStream": "heteroflow_client.client",
    "Task": "heteroflow_client.types",
    "TaskGroup": "heteroflow_client.types",
    "Service": "heteroflow_client.types",
    "Node": "heteroflow_client.types",
    "Model": "heteroflow_client.types",
    "EndpointKey": "heteroflow_client.types",
    "Me": "heteroflow_client.types",
    "LogLine": "heteroflow_client.types",
    "LogEnd": "heteroflow_client.types",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'heteroflow_client' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "__version__",
    "ApiError",
    "AuthError",
    "Client",
    "ConnectionFailed",
    "EndpointKey",
    "HeteroFlowError",
    "LogEnd",
    "LogLine",
    "LogStream",
    "Me",
    "Model",
    "Node",
    "NotFound",
    "Service",
    "Task",
    "TaskFailed",
    "TaskGroup",
    "ValidationError",
]
