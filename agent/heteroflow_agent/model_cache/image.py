"""A model shipped in a registry image: the image is pulled by the docker runtime (its
pull: retries, the node's credentials or the task's), a container is created from it and
never started, and the model's folder inside it is copied out (the engine's archive of
that path) into the model cache entry.

Where the weights are inside the image: the image's label `heteroflow.model.path`, else
`/models`. The whole folder is exported (a single-file model too: its folder). The
archive is unpacked with tarfile's "data" filter: no absolute paths, nothing outside the
entry, no device files, no links that leave it.
"""

from __future__ import annotations

import logging
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

from heteroflow_agent.model_cache.store import EnsureError
from heteroflow_agent.runtime import RuntimeError_

logger = logging.getLogger("heteroflow_agent.model_cache")

PATH_LABEL = "heteroflow.model.path"
DEFAULT_PATH = "/models"


class ImageExporter:
    def __init__(self, runtime):
        self.runtime = runtime  # a DockerRuntime: it pulls, and its engine client exports

    def size_of(self, image: str, credentials: dict | None) -> int:
        """Pull the image when it is not here; its size (an upper bound of the model's)."""
        try:
            self.runtime.ensure_image(image, credentials)
            found = self.runtime.engine_client().images.get(image)
        except RuntimeError_ as exc:
            raise EnsureError(f"cannot pull {image}: {exc}") from None
        except Exception as exc:  # the SDK's errors: the engine lost the image meanwhile, say
            raise EnsureError(f"cannot read {image}: {exc}") from None
        return int(found.attrs.get("Size") or 0)

    def export(self, image: str, folder: Path, advance: Callable[[int], None]) -> None:
        """Copy the image's model folder into `folder` (made anew), `advance(n)` for each
        n bytes of the archive read."""
        client = self.runtime.engine_client()
        try:
            labels = client.images.get(image).labels or {}
            inside = labels.get(PATH_LABEL) or DEFAULT_PATH
            container = client.containers.create(image, command=["true"], network_mode="none")
        except Exception as exc:
            raise EnsureError(f"cannot create a container of {image} to copy its model: {exc}") from None
        archive = folder.with_name(folder.name + ".tar.part")
        try:
            try:
                stream, _stat = container.get_archive(inside)
            except Exception as exc:
                raise EnsureError(f"{image} has no model at {inside} (label {PATH_LABEL}): {exc}") from None
            folder.parent.mkdir(parents=True, exist_ok=True)
            try:
                with archive.open("wb") as out:
                    for chunk in stream:
                        out.write(chunk)
                        advance(len(chunk))
            except EnsureError:  # cancelled: the agent is stopping
                raise
            except OSError as exc:
                raise EnsureError(f"cannot copy {image}'s model into the model cache: {exc}") from None
            except Exception as exc:  # the engine's stream broke off
                raise EnsureError(f"copying {image}'s model out of its container failed: {exc}") from None
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            unpack(archive, folder)
        finally:
            archive.unlink(missing_ok=True)
            try:
                container.remove(force=True)
            except Exception as exc:  # a leftover container is untidy, not a failure
                logger.warning("could not remove the container made to copy %s's model: %s", image, exc)


def unpack(archive: Path, folder: Path) -> None:
    """The archive's members under its top folder (the exported path's own name) into
    `folder`, through tarfile's data filter."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        tops = {member.name.split("/", 1)[0] for member in members}
        if len(tops) != 1:
            raise EnsureError(f"the image's model archive has {len(tops)} top entries, expected its folder")
        top = tops.pop()
        inner = []
        for member in members:
            if member.name == top:
                if member.isfile():  # the label named a file: keep it by its name
                    inner.append(member)
                continue
            member.name = member.name.split("/", 1)[1]
            inner.append(member)
        try:
            tar.extractall(folder, members=inner, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise EnsureError(f"cannot unpack the image's model: {exc}") from None
