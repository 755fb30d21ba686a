"""What every vendor reader shares: how its tool is found, run and judged.

A reader is an object the detector owns (not a module-level singleton) because some
keep state between beats: which fields the local nvidia-smi accepts, AMD's static card
names, an NVML handle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .command import ToolResult, find_command, first_line
from .model import Card, Reading
from .parsing import says_no_devices

Runner = Callable[[Sequence[str]], ToolResult]


class VendorTool:
    vendor = ""
    tools: Sequence[str] = ()  # tool names, tried in order
    args: Sequence[str] = ()  # arguments of the per-beat run

    def locate(self, root: str) -> str | None:
        """Where this vendor's tool is on this machine, or None: the vendor is absent."""
        for name in self.tools:
            path = find_command(name, root)
            if path:
                return path
        return None

    def read(self, path: str, run: Runner, *, slicing: bool = False) -> Reading:
        """One reading of every card. `slicing`: also read what slicing needs (MIG)."""
        return reading_from(run([path, *self.args]), self.parse)

    def parse(self, text: str) -> list[Card]:
        raise NotImplementedError

    def probe(self, path: str, run: Runner, card: str) -> Card | str:
        """Ask about one card by its key: the card, or why it could not be read."""
        return "this tool cannot be asked about one card"

    def topology(self, path: str, run: Runner) -> str | None:
        """The gpu-topology label value, or None when the vendor has none."""
        return None

    def health(self, path: str, run: Runner, keys: list[str], root: str = "/") -> dict[str, dict] | None:
        """Each card's health reading by card key (`keys`: the cards the detector knows),
        or None when this vendor's tool documents no health fields. Raises
        health.HealthError when the tool failed as a whole. Read every 30 s, not per beat."""
        return None


def reading_from(result: ToolResult, parse: Callable[[str], list[Card]]) -> Reading:
    """Judge one run: cards if any could be parsed, else why not.

    A non-zero exit that still printed cards is kept (nvidia-smi exits non-zero when one
    card of several is broken and still prints the others); a run that timed out is a
    failure whatever it printed, since its output was cut short.
    """
    source = result.argv[0]
    if result.timed_out or result.error:
        return Reading(error=result.describe(), source=source)
    try:
        cards = parse(result.stdout)
    except Exception as exc:  # a parser bug must not take the heartbeat down
        return Reading(error=f"could not parse {result.name} output: {type(exc).__name__}: {exc}", source=source)
    if cards:
        return Reading(cards=cards, source=source)
    if says_no_devices(result.stdout, result.stderr):
        said = first_line(result.stdout) or first_line(result.stderr)
        return Reading(no_devices=True, error=f"{result.name}: {said}", source=source)
    if not result.ok:
        return Reading(error=result.describe(), source=source)
    if not result.stdout.strip():
        return Reading(error=f"{result.name} printed nothing", source=source)
    return Reading(error=f"could not parse {result.name} output: {first_line(result.stdout, 120)!r}", source=source)
