"""The agent's version triple (version, git commit, build time), sent on every beat.

A built artefact carries `_build_info.json`, written by the build (the server's
`build_agent_dist` command) with the commit suffixed `-dirty` when the tree had
uncommitted changes. A plain development install has no such file and says so:
`dev` / `unknown` / `unknown`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BUILD_INFO = Path(__file__).with_name("_build_info.json")


@dataclass(frozen=True)
class Version:
    version: str
    git_commit: str
    build_time: str

    @property
    def dirty(self) -> bool:
        return self.git_commit.endswith("-dirty")


def current(path: Path = BUILD_INFO) -> Version:
    try:
        info = json.loads(path.read_text())
        return Version(str(info["version"]), str(info["git_commit"]), str(info["build_time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return Version("dev", "unknown", "unknown")
