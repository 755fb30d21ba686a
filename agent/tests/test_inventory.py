from heteroflow_agent.inventory import engines_from_tags, scan_models


def test_engines_need_the_exact_image_name():
    engines, versions = engines_from_tags(
        [
            "vllm/vllm-openai:v0.9.2",
            "172.29.0.1:5000/lmsysorg/sglang:latest",  # a private copy: does not count
            "lmsysorg/sglang-extra:1.0",  # a different image that shares a prefix
            "ollama/ollama:0.6.5",
            "localhost:5000/ollama",  # no tag, private registry
            "busybox:latest",
        ]
    )
    assert engines == ["ollama", "vllm"]
    assert versions == {"vllm": "v0.9.2", "ollama": "0.6.5"}


def test_no_images_no_engines():
    assert engines_from_tags([]) == ([], {})


def test_models_are_checkpoint_folders_and_gguf_files(tmp_path):
    cache = tmp_path / "cache"
    qwen = cache / "Qwen" / "Qwen2.5-7B-Instruct"
    qwen.mkdir(parents=True)
    (qwen / "config.json").write_text("{}")
    (qwen / "model-00001-of-00002.safetensors").write_bytes(b"x" * 100)
    (qwen / "nested").mkdir()
    (qwen / "nested" / "config.json").write_text("{}")  # inside a model: not a second model
    (cache / "llama-3-8b.Q4_K_M.gguf").write_bytes(b"g" * 10)
    (cache / "notes.txt").write_text("not a model")
    (tmp_path / "elsewhere").mkdir()
    (cache / "link").symlink_to(tmp_path / "elsewhere")
    found = scan_models([str(cache), str(tmp_path / "missing")])
    assert sorted((m["name"], m["format"]) for m in found) == [
        ("Qwen2.5-7B-Instruct", "safetensors"),
        ("llama-3-8b.Q4_K_M", "gguf"),
    ]
    qwen_entry = next(m for m in found if m["name"] == "Qwen2.5-7B-Instruct")
    assert qwen_entry["size_bytes"] == 102 and qwen_entry["path"] == str(qwen)


def test_the_scan_is_bounded(tmp_path):
    for i in range(20):
        (tmp_path / f"m{i}.gguf").write_bytes(b"")
    assert len(scan_models([str(tmp_path)], limit=5)) == 5
