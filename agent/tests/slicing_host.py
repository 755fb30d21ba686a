"""A scratch machine for the slice tests: stand-in vendor executables
(agent/tests/fixtures/slicing) that keep their state in a JSON file, so instances made
by one call are there for the next, under a scratch root (nothing installed on the
machine running the tests can answer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
STAND_INS = FIXTURES / "slicing"
A100 = "NVIDIA A100-SXM4-40GB"
H200 = "NVIDIA H200"

_WRAPPER = """#!{python} -S
STATE = {state!r}
__file__ = {source!r}
exec(compile(open({source!r}).read(), {source!r}, "exec"))
"""


class Cards:
    """A scratch machine with stand-in vendor tools and their shared state file."""

    def __init__(self, tmp_path: Path):
        self.root = tmp_path / "root"
        (self.root / "usr/bin").mkdir(parents=True)
        self.state_path = tmp_path / "state.json"
        self.write({"gpus": [], "dcus": [], "vdevs": [], "mps": {"alive": False}, "fail": {}, "sleep": {}})

    def install(self, name: str, source: str) -> Path:
        path = self.root / "usr/bin" / name
        path.write_text(
            _WRAPPER.format(python=sys.executable, state=str(self.state_path), source=str(STAND_INS / source))
        )
        path.chmod(0o755)
        return path

    def read(self) -> dict:
        return json.loads(self.state_path.read_text())

    def write(self, state: dict) -> None:
        self.state_path.write_text(json.dumps(state, indent=1))

    def update(self, **changes) -> None:
        state = self.read()
        state.update(changes)
        self.write(state)

    def nvidia(self, count: int = 1, model: str = A100, mig: bool = True, memory_mb: int = 40960) -> None:
        self.install("nvidia-smi", "nvidia_smi.py")
        gpus = [
            {
                "index": i,
                "uuid": f"GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a{70 + i}",
                "model": model,
                "mig": mig,
                "bus": f"00000000:{7 + i:02X}:00.0",
                "memory_mb": memory_mb,
                "gis": [],
            }
            for i in range(count)
        ]
        self.update(gpus=gpus)

    def health(self, index: int = 0, **counters) -> None:
        """Set card `index`'s health as `nvidia-smi -q -d ECC,...` will print it, by the
        agent's field names (ecc_uncorrected_volatile=2, remapped_rows_failure=True,
        throttle_reasons=["hw_slowdown"]); unset counters print 0, flags No."""
        state = self.read()
        state["gpus"][index].setdefault("health", {}).update(counters)
        self.write(state)

    def load(self, index: int = 0, *, memory_used_mb: int | None = None, power_w: float | None = None) -> None:
        """What card `index`'s metrics query will print as its memory in use (MiB) and its
        power draw (W); left out: as before (0 MiB, 52.10 W)."""
        state = self.read()
        card = state["gpus"][index]
        if memory_used_mb is not None:
            card["memory_used_mb"] = memory_used_mb
        if power_w is not None:
            card["power_w"] = f"{power_w:.2f}"
        self.write(state)

    def mps(self, alive: bool = True, servers=()) -> None:
        self.install("nvidia-cuda-mps-control", "mps_control.py")
        self.update(mps={"alive": alive, "servers": list(servers)})

    def hygon(self, count: int = 1, compute_units: int = 60, memory_bytes: int = 34342961152) -> None:
        self.install("hy-smi", "hy_smi.py")
        dcus = [{"index": i, "compute_units": compute_units, "memory_bytes": memory_bytes} for i in range(count)]
        self.update(dcus=dcus, hy_smi_json=str(FIXTURES / "hygon" / "hy-smi_1x_z100l.json"))

    def fail(self, **steps: str) -> None:
        state = self.read()
        state["fail"].update(steps)
        self.write(state)

    def calls(self, *prefix: str) -> list[list[str]]:
        return [call[1:] for call in self.read().get("calls", []) if list(call[1 : 1 + len(prefix)]) == list(prefix)]

    def instances(self, index: int = 0) -> list[dict]:
        return self.read()["gpus"][index]["gis"]
