"""An interactive task's app (docs/interactive.md): what the agent starts for a task of
kind `interactive`, bound to localhost inside the task on the task's host port, so that
only the tunnel reaches it (and any other process on a process-runtime node needs the
token). The token comes with the task and goes in the environment, never on a command
line that `ps` shows.

- `jupyter`: a Jupyter server (`jupyter_server`, with whatever front end the
  environment has: JupyterLab or Notebook answer at its root). Under the process
  runtime it runs under `python` (the agent's engine interpreter, HETEROFLOW_ENGINE_PYTHON,
  by default its own), which must have `jupyter_server`; in a container, the image's
  `jupyter` on its PATH.
- `shell`: nothing to serve; the task waits, for the portal's terminal and `hf ssh`.
"""

from __future__ import annotations

import subprocess

from heteroflow_agent.runtime.base import RuntimeError_

WAIT = ["sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"]


def base_url(task_id: int) -> str:
    """Where the control plane serves the task's app (its /apps/{id}/ proxy): the app's
    own base URL, so its links and WebSockets work through the proxy and hf open alike.
    The control plane spells the same (apps.tunnel.api.app_proxy.app_path)."""
    return f"/apps/{int(task_id)}/"


def jupyter_flags(task_id: int, port: int) -> list[str]:
    return [
        "--ip=127.0.0.1",
        f"--port={int(port)}",
        f"--ServerApp.base_url={base_url(task_id)}",
        # the browser's Host through the proxy is the control plane's: the token guards it
        "--ServerApp.allow_remote_access=True",
        "--ServerApp.port_retries=0",  # its own port or none: the tunnel and hf open go there
        "--no-browser",
        "--ServerApp.allow_root=True",  # a container's user is often root
    ]


def with_app(task: dict, *, runtime_kind: str, python: str) -> dict:
    """The task as the runtime starts it: its app's command and the token in its
    environment. Raises RuntimeError_ when the app cannot start here."""
    app = task.get("app") or "jupyter"
    if app == "shell":
        return {**task, "command": WAIT}
    if app != "jupyter":
        raise RuntimeError_(f"this agent does not know the app {app!r} (it knows jupyter and shell)")
    port = task.get("host_port")
    if not port:
        raise RuntimeError_("an interactive task needs its host port, and the control plane gave none")
    env = {**(task.get("env") or {}), "JUPYTER_TOKEN": str(task.get("app_token") or "")}
    if runtime_kind == "process":
        check_python_has(python, "jupyter_server")
        command = [python, "-m", "jupyter_server", *jupyter_flags(task["id"], port)]
    else:
        command = ["jupyter", "server", *jupyter_flags(task["id"], port)]
    return {**task, "command": command, "env": env}


def check_python_has(python: str, module: str) -> None:
    try:
        found = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError_(f"cannot run {python} to start the app: {exc}") from None
    if found.returncode != 0:
        raise RuntimeError_(
            f"{module} is not installed for {python} (HETEROFLOW_ENGINE_PYTHON): pip install {module.replace('_', '-')}"
        )
