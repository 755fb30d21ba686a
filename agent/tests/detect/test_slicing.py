"""Container detection, the MPS daemon check and the tier rule, on a scratch root."""

from __future__ import annotations

import pytest

from heteroflow_agent.detect.slicing import (
    TIER_MIG,
    TIER_MPS,
    TIER_SOFTWARE,
    capabilities,
    is_container,
    mps_daemon_alive,
)


def test_tiers_follow_the_spec():
    assert (TIER_MIG, TIER_MPS, TIER_SOFTWARE) == (1, 2, 9)


@pytest.mark.parametrize(
    "marker, content",
    [
        (".dockerenv", ""),
        ("run/.containerenv", ""),
        ("proc/1/cgroup", "12:pids:/docker/3f2a9c1d\n0::/system.slice/containerd.service\n"),
        ("proc/1/cgroup", "0::/kubepods/besteffort/pod1234/abcd\n"),
        ("proc/1/cgroup", "1:name=systemd:/machine.slice/libpod-4f3e.scope\n"),
    ],
)
def test_container_markers(host, marker, content):
    host.file(marker, content)
    assert is_container(str(host.root))


def test_a_plain_host_is_not_a_container(host):
    host.file("proc/1/cgroup", "0::/init.scope\n")
    assert not is_container(str(host.root))
    assert not is_container(str(host.root / "nowhere"))


def test_the_detector_finds_the_container_itself(host):
    host.file(".dockerenv")
    assert host.detector(is_container=None).detect().is_container
    assert not host.detector(is_container=False).detect().is_container


def _process(host, pid, comm, argv0, *args):
    host.file(f"proc/{pid}/comm", comm + "\n")
    host.file(f"proc/{pid}/cmdline", b"\x00".join([argv0.encode(), *[a.encode() for a in args]]) + b"\x00")


def test_mps_control_daemon_alive(host):
    _process(host, 1, "systemd", "/sbin/init")
    _process(host, 777, "nvidia-cuda-mps", "/usr/bin/nvidia-cuda-mps-control", "-d")
    assert mps_daemon_alive(str(host.root))


def test_the_mps_server_alone_is_not_the_control_daemon(host):
    """Both are "nvidia-cuda-mps" in comm (15 characters); argv[0] tells them apart."""
    _process(host, 778, "nvidia-cuda-mps", "nvidia-cuda-mps-server")
    assert not mps_daemon_alive(str(host.root))


def test_a_zombie_daemon_is_not_alive(host):
    host.file("proc/779/comm", "nvidia-cuda-mps\n")
    host.file("proc/779/cmdline", b"")
    assert not mps_daemon_alive(str(host.root))


def test_no_proc_no_daemon(host):
    assert not mps_daemon_alive(str(host.root))


def test_capability_rule():
    cards = [(0, "GPU-a"), (1, "GPU-b"), (2, "")]
    mig = {"GPU-a": True, "GPU-b": False}
    assert capabilities(cards, nvidia=True, mig=mig, mps_alive=True, container=False) == {
        "0": {"mig_capable": True, "mps_capable": True, "best_tier": 1},
        "1": {"mig_capable": False, "mps_capable": True, "best_tier": 2},
        "2": {"mig_capable": False, "mps_capable": True, "best_tier": 2},
    }
    software = {"mig_capable": False, "mps_capable": False, "best_tier": 9}
    assert set(map(str, capabilities(cards, nvidia=True, mig=mig, mps_alive=True, container=True).values())) == {
        str(software)
    }
    assert set(map(str, capabilities(cards, nvidia=False, mig=mig, mps_alive=True, container=False).values())) == {
        str(software)
    }
