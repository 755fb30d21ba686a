"""tests/llama.py, the real engine's helper: the tiny model it writes is what the recipe
says llama.cpp loads, and (where llama-cpp-python is installed) llama.cpp serves it."""

from __future__ import annotations

import pytest
import requests

from tests.llama import (
    BLOCKS,
    CONTEXT,
    EMBEDDING,
    FEED_FORWARD,
    HEADS,
    VOCAB,
    LlamaServer,
    require_llama_cpp,
    write_tiny_gguf,
)


def field(reader, name):
    value = reader.fields[name]
    return value.parts[value.data[0]].tolist()[0] if len(value.data) == 1 else None


def test_the_tiny_model_has_the_recipes_shape(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = write_tiny_gguf(tmp_path / "m" / "tiny.gguf")
    assert 400_000 < path.stat().st_size < 600_000
    reader = gguf.GGUFReader(str(path))
    assert field(reader, "llama.context_length") == CONTEXT
    assert field(reader, "llama.embedding_length") == EMBEDDING
    assert field(reader, "llama.feed_forward_length") == FEED_FORWARD
    assert field(reader, "llama.block_count") == BLOCKS
    assert field(reader, "llama.attention.head_count") == HEADS
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == VOCAB
    assert "tokenizer.chat_template" in reader.fields
    tensors = {tensor.name: tuple(int(n) for n in tensor.shape) for tensor in reader.tensors}
    assert len(tensors) == 3 + 9 * BLOCKS
    assert tensors["token_embd.weight"] == (EMBEDDING, VOCAB)  # gguf lists dimensions innermost first
    assert tensors["blk.1.ffn_down.weight"] == (FEED_FORWARD, EMBEDDING)


def test_llama_cpp_serves_the_tiny_model(tmp_path):
    require_llama_cpp()
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    with LlamaServer(path, alias="tiny") as server:
        assert [m["id"] for m in requests.get(f"{server.url}/v1/models", timeout=5).json()["data"]] == ["tiny"]
        answer = requests.post(
            f"{server.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        ).json()
        assert answer["choices"][0]["message"]["role"] == "assistant"
    assert server.process.poll() is not None  # stopped with the block
