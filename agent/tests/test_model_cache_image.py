"""A model shipped in a registry image (heteroflow_agent.model_cache.image), with the real
registry and container engine the image channel's tests use (scripts/registry.sh,
scripts/container-engine.sh; skipped without them, failed in CI): a model image is built
and pushed, removed from the engine, then ensured: pulled, its /models folder copied out
into the model cache, no container left behind."""

from __future__ import annotations

import io
import os
import tarfile
import uuid

import pytest
from agent.tests.channels.support import require_engine, require_registry
from agent.tests.model_cache_support import Reports

from heteroflow_agent.model_cache.ensure import ModelEnsurer
from heteroflow_agent.model_cache.image import ImageExporter
from heteroflow_agent.model_cache.store import EnsureError, ModelStore, NoRoom, entry_key
from heteroflow_agent.runtime.docker import DockerRuntime


@pytest.fixture(scope="module")
def model_image():
    """(the pushed reference, the weights in it): busybox with /models/tiny.gguf and a
    tokenizer beside it, pushed to the test registry and removed from the engine."""
    registry, engine = require_registry(), require_engine()
    weights = b"GGUF" + os.urandom(200_000)
    reference = f"{registry}/heteroflow/model-tiny:{uuid.uuid4().hex[:8]}"
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data in (
            ("Dockerfile", f"FROM {registry}/heteroflow/probe:1.0\nCOPY models /models\n".encode()),
            ("models/tiny.gguf", weights),
            ("models/tokenizer/vocab.txt", b"a\nb\n"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    context.seek(0)
    engine.images.build(fileobj=context, custom_context=True, tag=reference, rm=True)
    repository, tag = reference.rsplit(":", 1)
    engine.images.push(repository, tag=tag)
    engine.images.remove(reference, force=True)
    yield reference, weights
    try:
        engine.images.remove(reference, force=True)
    except Exception:
        pass


def image_serving(reference: str) -> dict:
    return {"engine": "llama.cpp", "model": "tiny", "format": "gguf", "source_kind": "image", "source": reference}


def containers_of(engine, reference: str) -> list:
    return [c for c in engine.containers.list(all=True) if reference in (c.attrs.get("Config") or {}).get("Image", "")]


def test_an_image_model_is_pulled_and_its_folder_copied_into_the_cache(tmp_path, model_image):
    reference, weights = model_image
    engine = require_engine()
    reports = Reports()
    models = ModelEnsurer(ModelStore(tmp_path / "cache"), images=ImageExporter(DockerRuntime()), report=reports)

    ensured = models.ensure(5, image_serving(reference))

    entry = tmp_path / "cache" / entry_key("image", reference)
    assert ensured.source == str(entry / "tiny.gguf")
    assert (entry / "tiny.gguf").read_bytes() == weights
    assert (entry / "tokenizer" / "vocab.txt").read_bytes() == b"a\nb\n"
    assert not list(tmp_path.glob("cache/*.tar.part"))
    assert reports.states()[0] == "fetching" and reports.states()[-1] == "ready"
    assert containers_of(engine, reference) == []  # the container made to copy it is gone
    assert models.store.in_use() == {entry.name}
    # a second replica finds it in the cache: nothing copied again
    assert not models.ensure(6, image_serving(reference)).fetched


def test_an_image_without_a_model_folder_fails_saying_where_it_looked(tmp_path):
    registry = require_registry()
    require_engine()
    models = ModelEnsurer(ModelStore(tmp_path / "cache"), images=ImageExporter(DockerRuntime()), report=Reports())
    with pytest.raises(EnsureError, match=r"^model tiny: .*probe:1.0 has no model at /models"):
        models.ensure(5, image_serving(f"{registry}/heteroflow/probe:1.0"))
    assert not (tmp_path / "cache" / entry_key("image", f"{registry}/heteroflow/probe:1.0")).exists()
    assert models.store.in_use() == set()


def test_an_image_that_cannot_be_pulled_fails_clearly(tmp_path):
    registry = require_registry()
    require_engine()
    models = ModelEnsurer(ModelStore(tmp_path / "cache"), images=ImageExporter(DockerRuntime()), report=Reports())
    with pytest.raises(EnsureError, match=r"^model tiny: cannot pull .*heteroflow/absent:1"):
        models.ensure(5, image_serving(f"{registry}/heteroflow/absent:1"))


def test_an_image_larger_than_the_budget_fails_before_copying(tmp_path, model_image):
    reference, _ = model_image
    models = ModelEnsurer(
        ModelStore(tmp_path / "cache", budget_bytes=1000), images=ImageExporter(DockerRuntime()), report=Reports()
    )
    with pytest.raises(NoRoom, match="the model cache budget is 1000 bytes"):
        models.ensure(5, image_serving(reference))


@pytest.mark.parametrize("evil", ["models/../../escape.txt", "/etc/evil"])
def test_an_archive_that_would_write_outside_the_entry_is_refused(tmp_path, evil):
    from heteroflow_agent.model_cache.image import unpack

    archive = tmp_path / "model.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("models/tiny.gguf", evil):
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"GGUF"))
    (tmp_path / "entry").mkdir()
    with pytest.raises(EnsureError):
        unpack(archive, tmp_path / "entry")
    assert not (tmp_path / "escape.txt").exists()
