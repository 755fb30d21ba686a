"""Finding and running vendor tools.

Fixed paths come before PATH because an agent started by systemd as root often has a
PATH without the vendor's install directory: WSL2 installs nvidia-smi in
/usr/lib/wsl/lib, and a bare PATH lookup once reported an RTX 4060 as a virtual GPU.
`root` prefixes every fixed and fallback path so tests can lay out a scratch
filesystem; PATH is this process's own and is searched as it is.

Every tool runs through `run_tool`, with a timeout: a vendor tool stuck on a wedged
driver must not stall the heartbeat, so it is killed (with anything it started) and
reported as a failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_TIMEOUT = 10.0

# Searched for every tool, in this order, after prefixing `root`.
FIXED_DIRS = ("usr/bin", "usr/local/bin", "usr/sbin", "usr/local/sbin")

# Per-tool places tried after the fixed directories and /opt/<tool>/bin, before PATH.
# nvidia-smi's two come from the spec (WSL2 and a CUDA tarball install); the others
# are the vendors' usual install directories.
FALLBACK_PATHS = {
    "nvidia-smi": ("usr/lib/wsl/lib/nvidia-smi", "opt/cuda/bin/nvidia-smi"),
    "npu-smi": ("usr/local/Ascend/driver/tools/npu-smi",),
    "hy-smi": ("opt/hyhal/bin/hy-smi",),
    "cnmon": ("usr/local/neuware/bin/cnmon",),
    "ixsmi": ("usr/local/corex/bin/ixsmi",),
    "mx-smi": ("opt/mxdriver/bin/mx-smi", "opt/maca/bin/mx-smi"),
    "xpu-smi": ("usr/local/xpu/bin/xpu-smi", "opt/xre/bin/xpu-smi"),
    "xpu_smi": ("usr/local/xpu/bin/xpu_smi", "opt/xre/bin/xpu_smi"),
    "amd-smi": ("opt/rocm/bin/amd-smi",),
    "rocm-smi": ("opt/rocm/bin/rocm-smi",),
}


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def candidate_paths(name: str, root: str = "/") -> list:
    """The fixed places `find_command` looks, in order (PATH not included)."""
    rels = [f"{d}/{name}" for d in FIXED_DIRS]
    rels.append(f"opt/{name}/bin/{name}")
    rels.extend(FALLBACK_PATHS.get(name, ()))
    return [os.path.join(root, rel) for rel in rels]


def find_command(name: str, root: str = "/") -> str | None:
    """Where the tool `name` is: fixed paths, per-tool fallbacks, then PATH; or None."""
    for path in candidate_paths(name, root):
        if _executable(path):
            return path
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if directory:
            path = os.path.join(directory, name)
            if _executable(path):
                return path
    return None


@dataclass
class ToolResult:
    argv: tuple
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    error: str = ""  # could not be started at all
    timeout: float = 0.0

    @property
    def name(self) -> str:
        return os.path.basename(self.argv[0]) if self.argv else "tool"

    @property
    def ok(self) -> bool:
        return not self.timed_out and not self.error and self.returncode == 0

    def describe(self) -> str:
        """One line saying how the run failed, for gpu_collector_error and logs."""
        if self.timed_out:
            return f"{self.name} timed out after {self.timeout:g}s and was killed"
        if self.error:
            return f"{self.name} could not run: {self.error}"
        detail = first_line(self.stderr) or first_line(self.stdout)
        if self.returncode != 0:
            return f"{self.name} exited with status {self.returncode}" + (f": {detail}" if detail else "")
        return f"{self.name}: {detail}" if detail else f"{self.name} printed nothing"


def first_line(text: str, limit: int = 300) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line[:limit]
    return ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def run_tool(argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT, *, input: str | None = None) -> ToolResult:
    """Run a tool to completion or kill it at `timeout` seconds. `input` is written to
    its stdin (nvidia-cuda-mps-control reads its commands there); without it, stdin is
    /dev/null.

    The tool gets its own session so that a timeout kills what it started too (a shell
    wrapper around the real binary, say). LC_ALL=C keeps numbers and messages in the
    form the parsers expect.
    """
    argv = tuple(str(a) for a in argv)
    env = dict(os.environ, LC_ALL="C", LANG="C")
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        return ToolResult(argv, error=exc.strerror or str(exc), timeout=timeout)
    try:
        out, err = proc.communicate(input=None if input is None else input.encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=2)
        except subprocess.TimeoutExpired:  # something escaped the group and holds the pipes
            for pipe in (proc.stdout, proc.stderr):
                if pipe:
                    pipe.close()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass  # stuck in the kernel (a wedged driver): unkillable; report the timeout anyway
            out, err = b"", b""
        return ToolResult(argv, proc.returncode, _text(out), _text(err), timed_out=True, timeout=timeout)
    return ToolResult(argv, proc.returncode, _text(out), _text(err), timeout=timeout)


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", "replace")
