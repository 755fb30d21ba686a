"""nvidia-mig: MIG instances made and unmade with nvidia-smi.

A create is `nvidia-smi mig -cgi PROFILE_ID -C -i IDX` (a GPU instance and its default
compute instance in one call); a destroy is `-dci -ci N -gi M -i IDX` for each compute
instance of the GPU instance, then `-dgi -gi M -i IDX`. What exists is read, never
assumed: before and after each request the card's instances are listed by joining
`nvidia-smi mig -lgi` (GPU instances), `-lci` (compute instances), the "MIG devices:"
section of the plain `nvidia-smi` table (GPU / GI / CI / MIG device index) and
`nvidia-smi -L` (MIG device index -> MIG UUID). The output formats are those of the
NVIDIA Multi-Instance GPU User Guide. `created` and `destroyed` in an outcome are the
difference between the two listings, so a create whose compute instance failed after
its GPU instance was made reports the GPU instance ({"uuid": "", "gi", "profile"}, no
"ci": the channel's instance entries have no nulls).
"""

from __future__ import annotations

import re

from heteroflow_agent.detect.command import ToolResult, first_line
from heteroflow_agent.detect.mig import (
    ListingError,
    list_instances,
    parse_listing,
    parse_profiles,
)

from .base import Budget, Outcome, OutOfTime, Vendor, gpu_index, refused

_CREATED_GI = re.compile(r"Successfully created GPU instance ID\s+(\d+) on GPU\s+(\d+)")
_CREATED_CI = re.compile(r"Successfully created compute instance ID\s+(\d+) on GPU\s+(\d+) GPU instance ID\s+(\d+)")


def _key(entry: dict) -> tuple:
    return (entry["gi"], entry.get("ci"))


def _tool_error(result: ToolResult) -> str:
    """What the tool said, for the report: its error lines, else how it failed."""
    lines = [line.strip() for line in (result.stderr + "\n" + result.stdout).splitlines() if "Unable" in line]
    said = lines[0] if lines else first_line(result.stderr) or first_line(result.stdout)
    exit_part = f"exit code {result.returncode}" if result.returncode is not None else result.describe()
    if result.timed_out or result.error:
        return result.describe()
    return f"{said} ({exit_part})" if said else result.describe()


class NvidiaMig(Vendor):
    name = "nvidia-mig"
    tool = "nvidia-smi"

    def _card(self, budget: Budget, path: str, params: dict) -> tuple[int | None, str]:
        """The card index, or why the request cannot be for this node's cards."""
        index = gpu_index(params)
        if index is None:
            return None, f"gpu_index {params.get('gpu_index')!r} is not a card index"
        listed = budget.run([path, "-L"])
        if not listed.ok:
            return None, f"cannot list the cards: {listed.describe()}"
        cards = parse_listing(listed.stdout)
        if index not in cards:
            return None, f"this node has no GPU {index} (nvidia-smi -L lists {sorted(cards) or 'none'})"
        wanted = params.get("gpu_uuid") or ""
        if wanted and cards[index]["uuid"] != wanted:
            return None, f"GPU {index} is {cards[index]['uuid']}, not {wanted}"
        return index, ""

    def _instances(self, budget: Budget, path: str, index: int) -> list[dict]:
        return list_instances(budget.run, path).get(index, [])

    def create(self, params: dict, budget: Budget) -> Outcome:
        path = self.path()
        if not path:
            return refused("nvidia-smi is not on this node")
        try:
            index, why = self._card(budget, path, params)
            if index is None:
                return refused(why)
            profile = str(params.get("profile") or "")
            shown = budget.run([path, "mig", "-lgip", "-i", str(index)])
            profiles = {p["name"]: p for p in parse_profiles(shown.stdout) if p["gpu"] == index}
            if not profiles:
                said = first_line(shown.stdout) or first_line(shown.stderr) or shown.describe()
                return refused(f"GPU {index} lists no MIG profiles (is MIG mode enabled?): {said}")
            if profile not in profiles:
                return refused(f"profile {profile!r} is not a MIG profile of GPU {index} ({', '.join(profiles)})")
            before = self._instances(budget, path, index)
            handles = params.get("handles") or {}
            device_id = params.get("device_id") or ""
            for entry in before:
                if (device_id and entry["uuid"] == device_id) or ("gi" in handles and entry["gi"] == handles.get("gi")):
                    return refused(
                        f"GPU {index} already has the instance gi {entry['gi']} ci {entry.get('ci')} "
                        f"{entry['uuid'] or ''} named by this request: not created again".replace("  ", " ")
                    )
            made = budget.run([path, "mig", "-cgi", str(profiles[profile]["id"]), "-C", "-i", str(index)])
        except (OutOfTime, ListingError) as exc:
            return Outcome(False, str(exc))
        try:
            after = self._instances(budget, path, index)
        except (OutOfTime, ListingError) as exc:
            # what the create said is all there is to go on
            gi = _CREATED_GI.search(made.stdout)
            ci = _CREATED_CI.search(made.stdout)
            created = [{"uuid": "", "gi": int(gi[1]), "profile": profile}] if gi else []
            if created and ci:
                created[0]["ci"] = int(ci[1])
            said = _tool_error(made) if not made.ok else "created"
            return Outcome(False, f"{said}; then could not list the instances: {exc}", created)
        old = {_key(e) for e in before}
        created = [e for e in after if _key(e) not in old]
        named = _CREATED_GI.search(made.stdout)
        if named and any(e["gi"] == int(named[1]) for e in created):
            # what this create made, not what someone else made meanwhile (an operator's
            # nvidia-smi): the server destroys what a failed create reports
            created = [e for e in created if e["gi"] == int(named[1])]
        complete = [e for e in created if "ci" in e and e["uuid"]]
        if made.ok and len(complete) == 1 and len(created) == 1:
            entry = complete[0]
            return Outcome(
                True, created=created, device_id=entry["uuid"], handles={"gi": entry["gi"], "ci": entry["ci"]}
            )
        if made.ok:
            error = f"nvidia-smi reported success but {len(complete)} complete new instances are listed on GPU {index}"
        else:
            error = _tool_error(made)
        return Outcome(False, error[:2000], created)

    def destroy(self, params: dict, budget: Budget) -> Outcome:
        path = self.path()
        if not path:
            return refused("nvidia-smi is not on this node")
        handles = params.get("handles") or {}
        gi = handles.get("gi")
        if not isinstance(gi, int) or isinstance(gi, bool):
            return refused(f"the destroy names no GPU instance (handles {handles!r})")
        device_id = params.get("device_id") or ""
        try:
            index, why = self._card(budget, path, params)
            if index is None:
                return refused(why)
            before = self._instances(budget, path, index)
            target = [e for e in before if e["gi"] == gi]
            if not target:
                # nothing of it is left (destroyed earlier, or never made): the goal holds
                return Outcome(True, handles={})
            named = handles.get("ci")
            for entry in target:
                other = entry["uuid"] and entry["uuid"] != device_id
                if device_id and other and (named is None or entry.get("ci") == named):
                    return refused(
                        f"gi {gi} ci {entry['ci']} on GPU {index} is now {entry['uuid']}, not {device_id}: "
                        "it belongs to something else and is not destroyed"
                    )
            failure = None
            for entry in target:
                if "ci" not in entry:
                    continue
                result = budget.run([path, "mig", "-dci", "-ci", str(entry["ci"]), "-gi", str(gi), "-i", str(index)])
                if not result.ok:
                    failure = result
                    break
            if failure is None:
                result = budget.run([path, "mig", "-dgi", "-gi", str(gi), "-i", str(index)])
                if not result.ok:
                    failure = result
            after = self._instances(budget, path, index)
        except (OutOfTime, ListingError) as exc:
            return Outcome(False, str(exc))
        left = [e for e in after if e["gi"] == gi]
        remaining = {_key(e) for e in left}
        destroyed = [{k: e[k] for k in ("uuid", "gi", "ci") if k in e} for e in target if _key(e) not in remaining]
        if failure is None and not left:
            return Outcome(True, destroyed=destroyed)
        error = _tool_error(failure) if failure is not None else f"gi {gi} is still listed on GPU {index}"
        still = {"gi": gi}
        cis = [e["ci"] for e in left if "ci" in e]
        if cis:
            still["ci"] = cis[0]
        return Outcome(False, error[:2000], destroyed=destroyed, handles=still)
