"""Reading the control-plane host with psutil. A reading the host cannot give is None,
never 0: a 0 °C CPU or a 0 % load would be a lie a dashboard cannot tell apart."""

from __future__ import annotations

import platform
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import psutil
from django.conf import settings

# Sensor chips that measure the CPU package itself, best first. Other chips (acpitz,
# nvme, wifi) measure something else and are not reported as the CPU's temperature.
CPU_SENSOR_CHIPS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal", "soc_thermal", "x86_pkg_temp")
# A sensor that answers 0 or less is broken or absent, not cold.
MIN_PLAUSIBLE_CELSIUS = 1.0


def host_name() -> str:
    """The name this host's samples are kept under."""
    return settings.HETEROFLOW_SERVER_METRICS_HOST or socket.gethostname()


def cpu_temperature(read: Callable[[], dict] | None = None) -> float | None:
    """The hottest reading of the first CPU chip the host has, or None when it has none
    (no sensors, a platform psutil cannot read them on, or no permission)."""
    if read is None:
        read = getattr(psutil, "sensors_temperatures", None)
        if read is None:
            return None
    try:
        chips = read() or {}
    except Exception:  # sensors behind missing permissions raise on some hosts
        return None
    for chip in CPU_SENSOR_CHIPS:
        readings = [entry.current for entry in chips.get(chip, ()) if entry.current is not None]
        readings = [value for value in readings if value >= MIN_PLAUSIBLE_CELSIUS]
        if readings:
            return float(max(readings))
    return None


def busy_fraction(before, after) -> float | None:
    """The share of CPU time spent busy between two psutil.cpu_times() readings."""

    def busy_and_total(times):
        values = times._asdict()
        # Linux counts guest time inside user and nice already.
        total = sum(values.values()) - values.get("guest", 0.0) - values.get("guest_nice", 0.0)
        idle = values.get("idle", 0.0) + values.get("iowait", 0.0)
        return total - idle, total

    busy_before, total_before = busy_and_total(before)
    busy_after, total_after = busy_and_total(after)
    elapsed = total_after - total_before
    if elapsed <= 0:
        return None
    return min(1.0, max(0.0, (busy_after - busy_before) / elapsed))


class CpuSampler:
    """CPU use since the previous call in this process, so a dashboard that polls every
    few seconds gets the load between its polls without waiting. A first call, or one
    after a long pause, measures for `window` seconds; one that comes sooner than
    `window` after the previous waits out the rest (a few milliseconds of CPU time
    would be noise)."""

    def __init__(
        self,
        *,
        window: float = 1.0,
        max_age: float = 120.0,
        times=psutil.cpu_times,
        clock=time.monotonic,
        sleep=time.sleep,
    ):
        self.window, self.max_age = window, max_age
        self._times, self._clock, self._sleep = times, clock, sleep
        self._last: tuple[float, object] | None = None
        self._lock = threading.Lock()

    def percent(self) -> tuple[float | None, float]:
        """(busy percent, the window it covers in seconds)."""
        with self._lock:
            now = self._clock()
            if self._last is None or now - self._last[0] > self.max_age:
                self._last = (now, self._times())
                self._sleep(self.window)
            elif now - self._last[0] < self.window:
                self._sleep(self.window - (now - self._last[0]))
            started_at, before = self._last
            now, after = self._clock(), self._times()
            self._last = (now, after)
        fraction = busy_fraction(before, after)
        return (None if fraction is None else round(fraction * 100, 2)), round(now - started_at, 3)


CPU = CpuSampler()


@dataclass(frozen=True)
class HostSample:
    cpu_percent: float | None
    memory_percent: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    disk_percent: float | None
    disk_used_bytes: int | None
    disk_total_bytes: int | None
    load_1: float | None
    load_5: float | None
    load_15: float | None
    net_recv_bytes: int | None
    net_sent_bytes: int | None
    uptime_seconds: int | None
    cpu_temperature_celsius: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def _read(reader, default=None):
    try:
        return reader()
    except Exception:
        return default


def read_host(
    *, cpu: CpuSampler = CPU, disk_path: str = "/", temperature=cpu_temperature, now_epoch=time.time
) -> tuple[HostSample, float]:
    """One reading of this host, and the CPU window it covers in seconds."""
    cpu_percent, cpu_window = cpu.percent()
    memory = _read(psutil.virtual_memory)
    disk = _read(lambda: psutil.disk_usage(disk_path))
    load = _read(psutil.getloadavg, (None, None, None))
    net = _read(psutil.net_io_counters)
    boot = _read(psutil.boot_time)
    sample = HostSample(
        cpu_percent=cpu_percent,
        memory_percent=memory.percent if memory else None,
        memory_used_bytes=(memory.total - memory.available) if memory else None,
        memory_total_bytes=memory.total if memory else None,
        disk_percent=disk.percent if disk else None,
        disk_used_bytes=disk.used if disk else None,
        disk_total_bytes=disk.total if disk else None,
        load_1=round(load[0], 3) if load[0] is not None else None,
        load_5=round(load[1], 3) if load[1] is not None else None,
        load_15=round(load[2], 3) if load[2] is not None else None,
        net_recv_bytes=net.bytes_recv if net else None,
        net_sent_bytes=net.bytes_sent if net else None,
        uptime_seconds=int(now_epoch() - boot) if boot else None,
        cpu_temperature_celsius=temperature(),
    )
    return sample, cpu_window


def byte_rate(previous: int | None, previous_at, current: int | None, at) -> float | None:
    """Bytes per second between two counter readings; None without a previous reading,
    or when the counter went backwards (the host rebooted, or its interfaces changed)."""
    if previous is None or current is None or previous_at is None:
        return None
    elapsed = (at - previous_at).total_seconds()
    if elapsed <= 0 or current < previous:
        return None
    return round((current - previous) / elapsed, 3)


def platform_facts() -> dict:
    return {"os": platform.system().lower(), "arch": platform.machine(), "python": platform.python_version()}
