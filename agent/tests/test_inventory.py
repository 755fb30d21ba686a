import pytest

from heteroflow_agent.inventory import cpu_facts, engines_from_tags, scan_models


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


@pytest.mark.parametrize(
    "cpuinfo,facts",
    [
        # two sockets, hyper-threads repeat the physical ids
        (
            "".join(
                f"processor\t: {i}\nmodel name\t: AMD EPYC 9654 96-Core Processor\nphysical id\t: {i % 2}\n\n"
                for i in range(8)
            ),
            {"cpu_model": "AMD EPYC 9654 96-Core Processor", "cpu_sockets": 2},
        ),
        # a VM: no physical id, so the sockets are unknown (absent), not 1
        (
            "processor\t: 0\nmodel name\t: QEMU Virtual CPU version 2.5+\n",
            {"cpu_model": "QEMU Virtual CPU version 2.5+"},
        ),
        # ARM: no model name at all
        ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n", {}),
        ("garbage without colons\n\x00\x01", {}),
        ("", {}),
        ("model name\t:    Intel(R)   Xeon(R)  " + "x" * 300 + "\nphysical id\t: n/a\n", None),
    ],
)
def test_cpu_facts_from_cpuinfo(tmp_path, cpuinfo, facts):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    found = cpu_facts(str(path))
    if facts is None:  # squeezed and cut to the schema's 200 characters; a bad physical id is ignored
        assert found["cpu_model"].startswith("Intel(R) Xeon(R) x") and len(found["cpu_model"]) == 200
        assert "cpu_sockets" not in found
    else:
        assert found == facts


def test_cpu_facts_of_an_unreadable_file_are_none(tmp_path):
    assert cpu_facts(str(tmp_path / "missing")) == {}
