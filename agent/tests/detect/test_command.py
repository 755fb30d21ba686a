"""find_command's search order (fixed paths, per-tool fallbacks, PATH) and run_tool."""

from __future__ import annotations

import os
import time

import pytest

from heteroflow_agent.detect import find_command, run_tool
from heteroflow_agent.detect.command import candidate_paths

from .conftest import rule


def test_fixed_paths_come_first_in_order(host):
    later = host.tool("npu-smi", rule(text="later"), at="usr/local/bin")
    first = host.tool("npu-smi", rule(text="first"), at="usr/bin")
    host.tool("npu-smi", rule(text="path"), at=None)
    assert find_command("npu-smi", root=str(host.root)) == str(first)
    first.unlink()
    assert find_command("npu-smi", root=str(host.root)) == str(later)


def test_opt_tool_bin_is_a_fixed_path(host):
    tool = host.tool("efsmi", rule(text=""), at="opt/efsmi/bin")
    assert find_command("efsmi", root=str(host.root)) == str(tool)


def test_wsl_nvidia_smi_is_found_when_path_does_not_have_it(host):
    """systemd's PATH lacks /usr/lib/wsl/lib; a bare PATH lookup once made an RTX 4060 a
    virtual GPU."""
    wsl = host.tool("nvidia-smi", rule(text=""), at="usr/lib/wsl/lib")
    assert os.environ["PATH"] == str(host.path_dir)
    assert find_command("nvidia-smi", root=str(host.root)) == str(wsl)


def test_cuda_tarball_nvidia_smi_is_a_fallback_after_wsl(host):
    cuda = host.tool("nvidia-smi", rule(text=""), at="opt/cuda/bin")
    assert find_command("nvidia-smi", root=str(host.root)) == str(cuda)
    wsl = host.tool("nvidia-smi", rule(text=""), at="usr/lib/wsl/lib")
    assert find_command("nvidia-smi", root=str(host.root)) == str(wsl)


def test_fallbacks_come_before_path_and_path_is_last(host):
    on_path = host.tool("hy-smi", rule(text=""), at=None)
    assert find_command("hy-smi", root=str(host.root)) == str(on_path)
    fallback = host.tool("hy-smi", rule(text=""), at="opt/hyhal/bin")
    assert find_command("hy-smi", root=str(host.root)) == str(fallback)


def test_fallback_paths_are_only_for_their_own_tool(host):
    host.tool("nvidia-smi", rule(text=""), at="opt/hyhal/bin")
    assert find_command("nvidia-smi", root=str(host.root)) is None


def test_the_order_of_the_fixed_places():
    assert candidate_paths("nvidia-smi", "/r") == [
        "/r/usr/bin/nvidia-smi",
        "/r/usr/local/bin/nvidia-smi",
        "/r/usr/sbin/nvidia-smi",
        "/r/usr/local/sbin/nvidia-smi",
        "/r/opt/nvidia-smi/bin/nvidia-smi",
        "/r/usr/lib/wsl/lib/nvidia-smi",
        "/r/opt/cuda/bin/nvidia-smi",
    ]


def test_not_executable_or_a_directory_is_not_a_tool(host):
    host.file("usr/bin/cnmon", "#!/bin/sh\n")  # mode 644
    (host.root / "usr/local/bin/cnmon").mkdir(parents=True)
    assert find_command("cnmon", root=str(host.root)) is None


def test_missing_tool_is_none(host):
    assert find_command("mx-smi", root=str(host.root)) is None


def test_run_tool_returns_output_and_status(host):
    tool = host.tool("ixsmi", rule(text="hello\n", err="warn\n", code=3))
    result = run_tool([str(tool), "-x"], timeout=5)
    assert (result.stdout, result.stderr, result.returncode, result.ok) == ("hello\n", "warn\n", 3, False)
    assert result.describe() == "ixsmi exited with status 3: warn"
    assert host.calls("ixsmi") == [["-x"]]


def test_run_tool_kills_a_hung_tool(host, tmp_path):
    pid_file = tmp_path / "pid"
    tool = host.tool("brsmi", rule(sleep=60, pid_file=pid_file))
    started = time.monotonic()
    result = run_tool([str(tool)], timeout=0.3)
    assert time.monotonic() - started < 5
    assert result.timed_out and not result.ok
    assert result.describe() == "brsmi timed out after 0.3s and was killed"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_run_tool_kills_what_the_tool_started(host, tmp_path):
    """A shell wrapper that starts the real (hung) binary: both go."""
    child_pid = tmp_path / "child.pid"
    script = host.file("usr/bin/wrapper", f"#!/bin/sh\n/bin/sleep 60 &\necho $! > {child_pid}\nwait\n")
    script.chmod(0o755)
    result = run_tool([str(script)], timeout=0.5)
    assert result.timed_out
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if os.path.exists(f"/proc/{pid}/stat") and open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z":
            break  # killed, waiting for its reaper
        time.sleep(0.05)
    else:
        pytest.fail("the tool's child survived the timeout")


def test_run_tool_reports_a_tool_that_cannot_start(tmp_path):
    result = run_tool([str(tmp_path / "absent-smi")], timeout=1)
    assert result.error and not result.ok
    assert result.describe().startswith("absent-smi could not run:")
