"""What the agent reads about its host: identity, load, network, container engine.

A reading that failed is left out rather than sent as 0, like the GPU metrics: the
server must be able to tell "idle" from "unknown".
"""

from __future__ import annotations

import ipaddress
import logging
import platform
import socket
from dataclasses import dataclass

import psutil

logger = logging.getLogger("heteroflow_agent.collect")

# Interfaces that are never the node's address: loopback and the bridges and veths of
# container engines and overlays.
VIRTUAL_INTERFACE_PREFIXES = (
    "lo",
    "docker",
    "br-",
    "veth",
    "cni",
    "flannel",
    "cali",
    "virbr",
    "podman",
    "tun",
    "tap",
    "kube",
    "vxlan",
    "weave",
)


def host_facts() -> dict:
    memory = psutil.virtual_memory()
    return {
        "hostname": socket.gethostname()[:255],
        "os": f"{platform.system()} {platform.release()}".strip()[:200],
        "cpu_cores": psutil.cpu_count(logical=True) or 1,
        "memory_gb": round(memory.total / 1024**3, 2),
    }


class LoadSampler:
    """CPU use between two samples: the previous call and this one (psutil keeps the
    first sample), so a beat costs no sleep; the first beat primes it."""

    def __init__(self):
        psutil.cpu_percent(interval=None)

    def sample(self) -> dict:
        load = {}
        try:
            load["cpu_used"] = min(max(psutil.cpu_percent(interval=None), 0.0), 100.0)
        except Exception as exc:  # never let a reading stop the beat
            logger.debug("cpu reading failed: %s", exc)
        try:
            load["memory_used"] = min(max(psutil.virtual_memory().percent, 0.0), 100.0)
        except Exception as exc:
            logger.debug("memory reading failed: %s", exc)
        return load


@dataclass(frozen=True)
class Address:
    """The node's internal address: its interface's IPv4 address and prefix length (the
    server tells a LAN by them), and that interface's MAC. Empty when there is none."""

    ip: str = ""
    prefix: int | None = None
    mac: str = ""


def primary_address() -> Address:
    """The first real interface that is up, in name order, skipping container bridges."""
    try:
        addresses = psutil.net_if_addrs()
        stats = psutil.net_if_stats()
    except Exception:
        return Address()
    for name in sorted(addresses):
        if name.startswith(VIRTUAL_INTERFACE_PREFIXES) or not getattr(stats.get(name), "isup", False):
            continue
        inet = next((a for a in addresses[name] if a.family == socket.AF_INET), None)
        mac = next((a.address for a in addresses[name] if a.family == psutil.AF_LINK), "")
        if inet and inet.address and not inet.address.startswith("127."):
            return Address(inet.address, prefix_length(inet.netmask), mac if mac and mac != "00:00:00:00:00:00" else "")
    return Address()


def prefix_length(netmask: str | None) -> int | None:
    """24 for 255.255.255.0; None when the netmask is missing or not a mask."""
    try:
        return ipaddress.IPv4Network(f"0.0.0.0/{netmask}").prefixlen if netmask else None
    except ValueError:
        return None


@dataclass
class EngineState:
    available: bool
    error: str = ""


class ContainerEngine:
    """The local Docker-compatible engine, through the docker SDK (imported only when
    first needed: it is the agent's largest dependency)."""

    def __init__(self, timeout: float = 5.0):
        self.timeout = timeout
        self._client = None

    def client(self):
        if self._client is None:
            import docker

            self._client = docker.from_env(timeout=self.timeout)
        return self._client

    def state(self) -> EngineState:
        try:
            self.client().ping()
            return EngineState(True)
        except Exception as exc:
            self._client = None  # reconnect next time: the engine may come up later
            return EngineState(False, f"no container engine: {type(exc).__name__}: {exc}"[:500])

    def image_tags(self) -> list[str]:
        """Every local image's repo:tag."""
        try:
            return [tag for image in self.client().images.list() for tag in (image.tags or [])]
        except Exception as exc:
            logger.debug("listing images failed: %s", exc)
            self._client = None
            return []
