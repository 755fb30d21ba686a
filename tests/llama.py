"""A real inference engine for tests: a tiny llama model written with the `gguf` package
(a second, ~490 KB; nothing is downloaded) and llama.cpp's OpenAI-compatible server
(llama-cpp-python's `python -m llama_cpp.server`) serving it. The text it writes is
noise; the protocol is the real one (/v1/models, /v1/chat/completions, streaming).

`.ci/run` installs llama-cpp-python from requirements/engines.txt (scripts/engines.sh:
built once, the wheel cached); elsewhere the tests that need it skip, saying
`LLAMA_CPP_MISSING`.

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    require_llama_cpp()                                # skips (or fails in CI) without it
    with LlamaServer(path, alias="tiny") as server:
        requests.get(f"{server.url}/v1/models")
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

LLAMA_CPP_MISSING = (
    "llama-cpp-python[server] is not installed in this environment: `bash scripts/engines.sh` "
    "installs it (requirements/engines.txt; a 7-20 minute build the first time, cached after)"
)

# the recipe tried on this kind of machine (shared/docs/RECIPES.md)
VOCAB, EMBEDDING, FEED_FORWARD, BLOCKS, HEADS, CONTEXT = 300, 64, 128, 2, 4, 512
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WORDS = (
    "the a of to and in is it you that he was for on are with as I his they be at one have this from or had by "
    "hot word but what some we can out"
).split()


def llama_cpp_available() -> bool:
    """Whether llama.cpp's server can run here (its modules are found; nothing imported)."""
    modules = ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
    return all(importlib.util.find_spec(name) is not None for name in modules)


def require_llama_cpp() -> None:
    """Skip the calling test when llama.cpp's server is not installed here, saying why;
    fail it instead where the environment promises the engine (`.ci/run` sets
    HETEROFLOW_REQUIRE_ENGINES=1 once scripts/engines.sh has installed it), so that a
    broken install cannot pass as a skip."""
    if llama_cpp_available():
        return
    if os.environ.get("HETEROFLOW_REQUIRE_ENGINES") == "1":
        pytest.fail(f"HETEROFLOW_REQUIRE_ENGINES=1 but {LLAMA_CPP_MISSING}")
    pytest.skip(LLAMA_CPP_MISSING)


def write_tiny_gguf(path: Path, *, name: str = "tiny", seed: int = 0) -> Path:
    """A llama model llama.cpp loads: vocabulary 300 (SentencePiece style: <unk> <s> </s>,
    the 256 byte tokens, then ▁words), embedding 64, feed-forward 128, 2 blocks, 4 heads,
    context 512, all-F32 small random weights, a chat template. About 490 KB."""
    import gguf
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{byte:02X}>".encode() for byte in range(256)]
    pieces = [f"\u2581{word}" for word in WORDS]
    pieces += [f"\u2581w{n}" for n in range(VOCAB - len(tokens) - len(pieces))]
    tokens += [piece.encode() for piece in pieces]
    assert len(tokens) == VOCAB
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(n) for n in range(len(pieces))]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBEDDING)
    writer.add_block_count(BLOCKS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(EMBEDDING // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", weights(VOCAB, EMBEDDING))
    writer.add_tensor("output_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
    writer.add_tensor("output.weight", weights(VOCAB, EMBEDDING))
    for block in range(BLOCKS):
        prefix = f"blk.{block}."
        writer.add_tensor(prefix + "attn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{prefix}{part}.weight", weights(EMBEDDING, EMBEDDING))
        writer.add_tensor(prefix + "ffn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        writer.add_tensor(prefix + "ffn_gate.weight", weights(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(prefix + "ffn_up.weight", weights(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(prefix + "ffn_down.weight", weights(EMBEDDING, FEED_FORWARD))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_server_argv(model: Path, port: int, *, alias: str, host: str = "127.0.0.1", args=()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--model_alias",
        alias,
        "--n_ctx",
        str(CONTEXT),
        *args,
    ]


def models_answer(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as answer:
            return answer.status == 200
    except OSError:
        return False


class LlamaServer:
    """llama.cpp's server on a free port of 127.0.0.1 serving `model` as `alias`, until
    the block ends (a gateway test's real upstream). `url` is http://127.0.0.1:PORT."""

    def __init__(self, model: Path, *, alias: str = "tiny", log: Path | None = None, args=(), start_timeout=60):
        self.model, self.alias, self.args, self.start_timeout = Path(model), alias, tuple(args), start_timeout
        self.log = Path(log) if log else self.model.with_suffix(".server.log")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                llama_server_argv(self.model, self.port, alias=self.alias, args=self.args),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.start_timeout
        while not models_answer(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"llama.cpp's server did not come up:\n{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)

    def __exit__(self, *exc) -> None:
        self.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
