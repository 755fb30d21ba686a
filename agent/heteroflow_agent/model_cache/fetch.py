"""A hub model from the operator's mirror, over plain HTTP(S), with one of two listings
(docs/inference.md, "The hub mirror"):

- `manifest`: for a model whose source is `org/name`, `<mirror>/org/name/manifest.json`
  holds `{"files": [{"path": "model.gguf", "size": 1234, "sha256": "<64 hex>"}, ...]}`
  (`sha256` optional) and each file is served at `<mirror>/org/name/<path>`. A source
  that is itself an http(s) URL is the model's base, no mirror needed;
- `huggingface`: a Hugging Face–compatible endpoint (what HF_ENDPOINT names): the
  listing is `<endpoint>/api/models/org/name/revision/main?blobs=true` (its `siblings`:
  `rfilename`, `size`, and `lfs.sha256` for the large files), each file
  `<endpoint>/org/name/resolve/main/<path>`. Read with this module's own HTTP, not
  huggingface_hub (not a dependency of the agent), so it resumes and checks the same way.

Each file is downloaded to `<path>.part` and renamed when whole. A `.part` left by a cut
connection (or a restarted agent) is resumed with an HTTP Range request; a server that
answers the whole file instead (200) is read from the start. When the listing gives a
checksum, the whole file is checked before the rename: a mismatch deletes the part and
fails, naming the file and both digests.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import requests

from heteroflow_agent.model_cache.store import EnsureError

logger = logging.getLogger("heteroflow_agent.model_cache")

MANIFEST = "manifest.json"
CHUNK = 1 << 20  # hashing
# a read that a cut connection interrupts loses what it had buffered: small reads keep
# the part close to what really arrived, so that the resume asks for little again
STREAM_CHUNK = 64 * 1024
MAX_FILES = 10_000
SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ListedFile:
    path: str
    size: int
    sha256: str  # "": the listing gives none


MANIFEST_API, HUGGINGFACE_API = "manifest", "huggingface"
HUB_APIS = (MANIFEST_API, HUGGINGFACE_API)


@dataclass(frozen=True)
class Hub:
    """Where a hub model's listing is, and the URL its files' paths are under."""

    listing_url: str
    files_url: str
    api: str


def hub_of(mirror: str, source: str, api: str = MANIFEST_API) -> Hub:
    if source.startswith(("http://", "https://")):
        base = source.rstrip("/")
        return Hub(f"{base}/{MANIFEST}", base, MANIFEST_API)
    if not mirror:
        raise EnsureError(
            f"hub model {source!r}: this node has no model mirror (set model_hub_url, or HF_ENDPOINT, in the "
            "agent's environment or config)"
        )
    mirror, repository = mirror.rstrip("/"), source.strip("/")
    if api == HUGGINGFACE_API:
        return Hub(
            f"{mirror}/api/models/{repository}/revision/main?blobs=true",
            f"{mirror}/{repository}/resolve/main",
            api,
        )
    return Hub(f"{mirror}/{repository}/{MANIFEST}", f"{mirror}/{repository}", MANIFEST_API)


def parse_huggingface(data, where: str) -> list[ListedFile]:
    """A Hugging Face model listing's files, checked as a manifest's are."""
    siblings = data.get("siblings") if isinstance(data, dict) else None
    if not isinstance(siblings, list):
        raise EnsureError(f"{where}: expected a model with 'siblings' (a Hugging Face–compatible endpoint?)")
    files = []
    for sibling in siblings:
        lfs = (sibling.get("lfs") if isinstance(sibling, dict) else None) or {}
        if not isinstance(sibling, dict) or not isinstance(lfs, dict):
            raise EnsureError(f"{where}: a sibling {sibling!r} is not an object")
        size = sibling.get("size", lfs.get("size"))
        files.append({"path": sibling.get("rfilename"), "size": size, "sha256": lfs.get("sha256") or ""})
    return parse_manifest({"files": files}, where)


def parse_manifest(data, where: str) -> list[ListedFile]:
    """The listing's files, every entry checked: a relative path inside the model (no
    '..', not absolute), a size, a sha256 of 64 hex digits when given."""
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not files:
        raise EnsureError(f"{where}: expected {{'files': [{{'path', 'size', 'sha256'}}, ...]}}")
    if len(files) > MAX_FILES:
        raise EnsureError(f"{where}: {len(files)} files, at most {MAX_FILES}")
    listed, seen = [], set()
    for item in files:
        path = item.get("path") if isinstance(item, dict) else None
        size = item.get("size") if isinstance(item, dict) else None
        digest = str(item.get("sha256") or "").lower() if isinstance(item, dict) else ""
        pure = PurePosixPath(path) if isinstance(path, str) and path else None
        if (
            pure is None
            or pure.is_absolute()
            or ".." in pure.parts
            or "\\" in path
            or pure.name.endswith(".part")
            or pure.name.startswith(".heteroflow")
        ):
            raise EnsureError(f"{where}: file path {path!r} must be relative, inside the model")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise EnsureError(f"{where}: {path}: size {size!r} must be a whole number of bytes")
        if digest and not SHA256.match(digest):
            raise EnsureError(f"{where}: {path}: sha256 {digest!r} must be 64 hex digits")
        if str(pure) in seen:
            raise EnsureError(f"{where}: {path} is listed twice")
        seen.add(str(pure))
        listed.append(ListedFile(str(pure), size, digest))
    return listed


class Fetcher:
    def __init__(self, *, timeout: tuple[float, float] = (10.0, 60.0), attempts: int = 5):
        self.timeout, self.attempts = timeout, attempts
        self.session = requests.Session()
        self.session.headers["User-Agent"] = "heteroflow-agent"

    def listing(self, hub: Hub) -> list[ListedFile]:
        url = hub.listing_url
        try:
            answer = self.session.get(url, timeout=self.timeout)
        except requests.RequestException as exc:
            raise EnsureError(f"cannot read {url}: {exc}") from None
        if answer.status_code != 200:
            raise EnsureError(f"cannot read {url}: HTTP {answer.status_code}")
        try:
            data = answer.json()
        except ValueError:
            raise EnsureError(f"{url} is not JSON") from None
        return parse_huggingface(data, url) if hub.api == HUGGINGFACE_API else parse_manifest(data, url)

    def download(self, base: str, item: ListedFile, folder: Path, advance: Callable[[int], None]) -> None:
        """`item` into `folder`, resumed from its .part; `advance(n)` for each n bytes
        written. A cut connection is resumed up to `attempts` times in all."""
        target = folder / item.path
        part = target.with_name(target.name + ".part")
        part.parent.mkdir(parents=True, exist_ok=True)
        url = f"{base}/{item.path}"
        problem = ""
        for attempt in range(1, self.attempts + 1):
            have = part.stat().st_size if part.exists() else 0
            if have > item.size:  # not this file's beginning: start again
                part.unlink()
                have = 0
            if have < item.size or item.size == 0:
                try:
                    self._stream(url, part, have, item.size, advance)
                except (requests.RequestException, OSError) as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                    logger.info("model file %s: %s (attempt %d, resuming)", url, problem, attempt)
                    continue
                except _Refused as exc:
                    raise EnsureError(f"cannot download {url}: {exc}") from None
            got = part.stat().st_size
            if got != item.size:
                problem = f"{got} bytes of {item.size}"
                continue
            if item.sha256:
                digest = file_sha256(part)
                if digest != item.sha256:
                    part.unlink()
                    raise EnsureError(
                        f"{url}: checksum mismatch (sha256 {digest}, the listing says {item.sha256}); "
                        "the partial file was deleted"
                    )
            part.replace(target)
            return
        raise EnsureError(f"cannot download {url}: {problem} after {self.attempts} attempts")

    def _stream(self, url: str, part: Path, have: int, size: int, advance: Callable[[int], None]) -> None:
        headers = {"Range": f"bytes={have}-"} if have else {}
        with self.session.get(url, headers=headers, stream=True, timeout=self.timeout) as answer:
            if answer.status_code == 206 and have:
                mode = "ab"
            elif answer.status_code == 200:
                if have:
                    logger.info("model file %s: the server ignores Range; downloading it again", url)
                    advance(-have)
                mode = "wb"
            elif answer.status_code == 416 and have == size:
                return
            else:
                raise _Refused(f"HTTP {answer.status_code}")
            with part.open(mode) as out:
                for chunk in answer.iter_content(STREAM_CHUNK):
                    out.write(chunk)
                    advance(len(chunk))


class _Refused(Exception):
    """An answer that retrying cannot change (404, 403...)."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()
