"""Build what nodes install the agent from: the agent wheel (stamped with its version,
commit and build time) and its dependency wheels for each architecture, with
SHA256SUMS. See docs/agent-install.md and apps/nodes/distribution.py.

    python manage.py build_agent_dist                       # x86_64 and aarch64
    python manage.py build_agent_dist --arch x86_64         # one architecture
    python manage.py build_agent_dist --offline             # no network: wheels on disk only

Wheels already in the wheelhouse are reused, so only the first build needs PyPI.
"""

from __future__ import annotations

import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from apps.nodes import distribution


class Command(BaseCommand):
    help = (
        "Build the agent wheel and gather its dependency wheels per architecture into "
        "HETEROFLOW_AGENT_DIST_DIR, so nodes install from this control plane alone."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--arch",
            action="append",
            metavar="ARCH",
            help=f"an architecture to build for ({', '.join(distribution.SUPPORTED_ARCHES)}; "
            "aliases amd64, arm64); repeatable. Default: all of them.",
        )
        parser.add_argument(
            "--offline",
            action="store_true",
            help="use only wheels already on disk (the wheelhouse and --find-links); never the package index",
        )
        parser.add_argument(
            "--refresh",
            action="store_true",
            help="ask the package index again even when the wheelhouse can satisfy the pins (newer transitive dependencies)",
        )
        parser.add_argument(
            "--rebuild",
            action="store_true",
            help="rebuild the agent wheel even if this commit and source were built before",
        )
        parser.add_argument("--dist-dir", type=Path, help="where to publish (default: HETEROFLOW_AGENT_DIST_DIR)")
        parser.add_argument(
            "--wheelhouse",
            type=Path,
            help="where downloaded wheels are kept and reused (default: <dist dir>/wheelhouse)",
        )
        parser.add_argument(
            "--find-links",
            type=Path,
            action="append",
            default=[],
            metavar="DIR",
            help="another folder of wheels to take from; repeatable",
        )
        parser.add_argument("--source", type=Path, help="the agent's source folder (default: <repository>/agent)")

    def handle(self, *args, **options):
        arches = []
        for name in options["arch"] or distribution.SUPPORTED_ARCHES:
            arch = distribution.normalize_arch(name)
            if arch is None:
                raise CommandError(
                    f"unknown architecture {name!r}: choose from {', '.join(distribution.SUPPORTED_ARCHES)} (or amd64, arm64)"
                )
            if arch not in arches:
                arches.append(arch)
        build_options = distribution.BuildOptions(
            arches=arches,
            offline=options["offline"],
            refresh=options["refresh"],
            rebuild=options["rebuild"],
            root=options["dist_dir"],
            wheelhouse=options["wheelhouse"],
            source=options["source"],
            find_links=options["find_links"],
        )
        if build_options.offline and build_options.refresh:
            raise CommandError("--offline and --refresh contradict each other")
        started = time.monotonic()

        def say(line):
            self.stdout.write(f"build_agent_dist: {line}")
            self.stdout.flush()

        say(
            f"building for {', '.join(arches)} into {build_options.root}"
            + (" (offline)" if build_options.offline else "")
        )
        try:
            result = distribution.build_dist(build_options, say=say)
        except distribution.BuildError as exc:
            raise CommandError(f"build_agent_dist: {exc}") from None
        elapsed = time.monotonic() - started
        for arch, build in result.builds.items():
            say(
                f"{arch}: served at {distribution.AGENT_PATH}/dist/{arch}/ ({distribution.SUMS_NAME} lists {len(build.sums)} files)"
            )
        if result.failures:
            raise CommandError(
                f"build_agent_dist: {len(result.failures)} of {len(arches)} architectures failed after {elapsed:.1f} s:\n"
                + "\n".join(result.failures.values())
            )
        agent = result.agent
        say(
            f"done in {elapsed:.1f} s: agent {agent['version']} ({agent['git_commit']}, built {agent['build_time']}). "
            f"Nodes install with: curl -fsSL http://<this server>:<port>{distribution.AGENT_PATH}/install.sh | sudo bash -s -- --key <agent key>"
        )
