"""hygon-hami: a vDCU (virtual DCU) carved with the Hygon driver's virtualization tool.

The commands are those HAMi's DCU support is built on (Project-HAMi/dcu-vgpu-device-plugin
and HAMi's docs/hygon-dcu-support.md): `hy-smi virtual` (dtk 6.2.26 and later; older
drivers ship the same options as `hy-virtual`):

    hy-smi virtual -show-device-info        "Device N:" blocks: Actual Device, Compute
                                            units, Global memory: <bytes> bytes
    hy-smi virtual -show-vdevice-info       "Virtual Device K:" blocks, the same fields
    hy-smi virtual -create-vdevices 1 -d N -vdevice-compute-units CU -vdevice-memory-size MiB
    hy-smi virtual -d N -destroy-vdevice    destroys EVERY vDCU of card N

The slice's compute share becomes compute units (round(total × percent / 100), at
least 1), its memory the vDCU's memory in MiB. The new vDCU is found by listing before
and after. A task uses vDCU K by mounting /etc/vdev/vdevK.conf at
/etc/vdev/docker/vdevK.conf (the driver reads it there) with /dev/kfd, /dev/dri and
/dev/mkfd.

The tool cannot destroy one vDCU of a card: a destroy runs only when every other vDCU
of that card is itself waiting to be destroyed (asked for by an earlier destroy); until
then it is refused and the server asks again later, and it then finds its vDCU gone.
"""

from __future__ import annotations

import re

from heteroflow_agent.detect.command import find_command, first_line
from heteroflow_agent.detect.hygon import parse_devices

from .base import Budget, Outcome, OutOfTime, Vendor, gpu_index, refused

VDEV_CONF = "/etc/vdev/vdev{}.conf"
VDEV_IN_CONTAINER = "/etc/vdev/docker/vdev{}.conf"


def virtual_tool(root: str = "/") -> list[str] | None:
    """The argv prefix of the vDCU tool: `hy-smi virtual`, else `hy-virtual`."""
    path = find_command("hy-smi", root)
    if path:
        return [path, "virtual"]
    path = find_command("hy-virtual", root)
    return [path] if path else None


def hami_capable(run, root: str = "/") -> dict[int, bool]:
    """Card index -> whether the vDCU tool works for it (lists it), for the heartbeat."""
    tool = virtual_tool(root)
    if tool is None:
        return {}
    result = run([*tool, "-show-device-info"])
    if not result.ok:
        return {}
    return {row["device"]: True for row in parse_devices(result.stdout)}


class HygonHami(Vendor):
    name = "hygon-hami"

    def __init__(self, root: str = "/"):
        super().__init__(root)
        self.doomed: set[int] = set()  # vDCUs a destroy asked for and the tool could not destroy alone

    def _list(self, budget: Budget, tool: list[str], what: str) -> list[dict]:
        result = budget.run([*tool, what])
        if not result.ok:
            raise _Failed(f"{' '.join(tool[-1:])} {what}: {result.describe()}")
        return parse_devices(result.stdout)

    def create(self, params: dict, budget: Budget) -> Outcome:
        tool = virtual_tool(self.root)
        if tool is None:
            return refused("neither hy-smi nor hy-virtual is on this node")
        index = gpu_index(params)
        if index is None:
            return refused(f"gpu_index {params.get('gpu_index')!r} is not a card index")
        memory, percent = params.get("memory_mb"), params.get("compute_percent")
        if not isinstance(memory, int) or memory <= 0:
            return refused(f"memory_mb {memory!r} is not a limit")
        if not isinstance(percent, int) or not 1 <= percent <= 100:
            return refused(f"compute_percent {percent!r} is not a share (1-100)")
        try:
            cards = {row["device"]: row for row in self._list(budget, tool, "-show-device-info")}
            if index not in cards:
                return refused(f"this node has no DCU {index} (the vDCU tool lists {sorted(cards) or 'none'})")
            card = cards[index]
            if memory > card["memory_mib"]:
                return refused(f"{memory} MiB is more than DCU {index} has ({card['memory_mib']} MiB)")
            before = self._list(budget, tool, "-show-vdevice-info")
            named = vdev_of(params)
            if named is not None and any(v["id"] == named for v in before):
                return refused(f"vDCU {named} named by this request already exists: not created again")
            units = max(1, round(card["compute_units"] * percent / 100))
            made = budget.run(
                [
                    *tool,
                    "-create-vdevices",
                    "1",
                    "-d",
                    str(index),
                    "-vdevice-compute-units",
                    str(units),
                    "-vdevice-memory-size",
                    str(memory),
                ]
            )
            after = self._list(budget, tool, "-show-vdevice-info")
        except (OutOfTime, _Failed) as exc:
            return Outcome(False, str(exc))
        old = {v["id"] for v in before}
        new = [v for v in after if v["id"] not in old]
        created = [_entry(v) for v in new]
        if made.ok and len(new) == 1 and new[0]["device"] == index:
            vdev = new[0]
            return Outcome(
                True,
                created=created,
                device_id=f"vdev{vdev['id']}",
                handles={
                    "vdev": vdev["id"],
                    "compute_units": vdev["compute_units"],
                    "memory_mib": vdev["memory_mib"],
                    "conf": VDEV_CONF.format(vdev["id"]),
                },
            )
        said = first_line(made.stderr) or first_line(made.stdout) or made.describe()
        error = said if not made.ok else f"the tool said {said!r} but {len(new)} new vDCUs are listed"
        if not made.ok and made.returncode is not None:
            error += f" (exit code {made.returncode})"
        return Outcome(False, error[:2000], created)

    def destroy(self, params: dict, budget: Budget) -> Outcome:
        tool = virtual_tool(self.root)
        if tool is None:
            return refused("neither hy-smi nor hy-virtual is on this node")
        index = gpu_index(params)
        vdev = vdev_of(params)
        if index is None or vdev is None:
            return refused(
                f"the destroy names no vDCU (gpu_index {params.get('gpu_index')!r}, "
                f"handles {params.get('handles')!r}, device id {params.get('device_id')!r})"
            )
        try:
            before = self._list(budget, tool, "-show-vdevice-info")
            target = next((v for v in before if v["id"] == vdev), None)
            if target is None:
                self.doomed.discard(vdev)
                return Outcome(True)  # gone already (destroyed with its card's others)
            if target["device"] != index:
                return refused(f"vDCU {vdev} is on DCU {target['device']}, not {index}: not destroyed")
            others = [v["id"] for v in before if v["device"] == index and v["id"] != vdev]
            if any(other not in self.doomed for other in others):
                self.doomed.add(vdev)
                return refused(
                    f"the vDCU tool destroys every vDCU of a card and DCU {index} also holds vDCU "
                    f"{', '.join(str(o) for o in others)} in use: vDCU {vdev} is destroyed with the last of them"
                )
            result = budget.run([*tool, "-d", str(index), "-destroy-vdevice"])
            after = self._list(budget, tool, "-show-vdevice-info")
        except (OutOfTime, _Failed) as exc:
            return Outcome(False, str(exc))
        gone = {v["id"] for v in before} - {v["id"] for v in after}
        destroyed = [{"uuid": f"vdev{v}"} for v in sorted(gone)]
        self.doomed -= gone
        if result.ok and vdev in gone:
            return Outcome(True, destroyed=destroyed)
        said = first_line(result.stderr) or first_line(result.stdout) or result.describe()
        return Outcome(False, said[:2000], destroyed=destroyed, handles={"vdev": vdev})


class _Failed(Exception):
    pass


def _entry(vdev: dict) -> dict:
    """A vDCU as the channel's instance entry: its device id, and a profile naming its
    size (compute units and MiB)."""
    return {"uuid": f"vdev{vdev['id']}", "profile": f"{vdev['compute_units']}cu.{vdev['memory_mib']}mib"[:32]}


def vdev_of(params: dict) -> int | None:
    """The vDCU a request names: handles.vdev, else its device id "vdevK"."""
    named = (params.get("handles") or {}).get("vdev")
    if isinstance(named, int) and not isinstance(named, bool):
        return named
    m = re.fullmatch(r"vdev(\d+)", str(params.get("device_id") or ""))
    return int(m[1]) if m else None
