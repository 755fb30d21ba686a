import json

import pytest

from heteroflow_agent.config import ALWAYS_SCANNED_MODEL_DIR, DEFAULT_MODEL_DIRS, ConfigError, load, unknown_environment


def write(tmp_path, **values):
    path = tmp_path / "agent-config.json"
    path.write_text(json.dumps(values))
    return path


BASE = {"server_url": "http://10.0.0.5:3333", "api_key": "k" * 24}


def test_a_file_with_the_environment_over_it(tmp_path):
    path = write(tmp_path, **BASE, heartbeat_interval=10, data_dir=str(tmp_path / "data"), labels={"rack": "r1"})
    cfg = load(path, {"HETEROFLOW_HEARTBEAT_INTERVAL": "30", "HETEROFLOW_SERVER_URL": "https://cp.example:3333/"})
    assert (cfg.server_url, cfg.heartbeat_interval, cfg.labels) == ("https://cp.example:3333", 30, {"rack": "r1"})
    assert cfg.api_key == "k" * 24


def test_the_environment_alone_is_enough_and_the_local_agent_key_is_the_server_secret(tmp_path):
    cfg = load(
        None,
        {
            "HETEROFLOW_SERVER_URL": "http://127.0.0.1:3333",
            "HETEROFLOW_AGENT_SECRET": "s" * 20,
            "HETEROFLOW_AGENT_DATA_DIR": str(tmp_path),
        },
    )
    assert cfg.api_key == "s" * 20 and cfg.heartbeat_interval == 5


def test_the_node_id_is_made_once_and_kept_across_restarts(tmp_path):
    env = {
        "HETEROFLOW_SERVER_URL": "http://h:1",
        "HETEROFLOW_AGENT_KEY": "k",
        "HETEROFLOW_AGENT_DATA_DIR": str(tmp_path),
    }
    first = load(None, env).node_id
    assert load(None, env).node_id == first
    assert (tmp_path / "node-id").read_text().strip() == first
    assert load(None, env | {"HETEROFLOW_NODE_ID": "gpu-07"}).node_id == "gpu-07"


@pytest.mark.parametrize(
    "values,problem",
    [
        ({"heartbeat_interval": 4}, "heartbeat_interval 4 is outside 5..300"),
        ({"heartbeat_interval": 301}, "outside 5..300"),
        ({"heartbeat_interval": "often"}, "is not a whole number"),
        ({"heartbeat_interval": 7.5}, "is not a whole number"),
        ({"server_url": "10.0.0.5:3333"}, "must be an http:// or https:// URL"),
        ({"server_url": ""}, "server_url is required"),
        ({"api_key": ""}, "api_key is required"),
        ({"node_id": "no spaces please"}, "node_id"),
        ({"colour": "red"}, "unknown key 'colour'"),
        ({"allow_process_runtime": "perhaps"}, "is not true or false"),
        ({"model_scan_dirs": ["relative/path"]}, "absolute paths"),
        ({"labels": {"bad key!": "x"}}, "labels"),
    ],
)
def test_bad_values_are_refused_naming_the_problem(tmp_path, values, problem):
    path = write(tmp_path, **(BASE | {"data_dir": str(tmp_path)} | values))
    with pytest.raises(ConfigError) as caught:
        load(path, {})
    assert any(problem in p for p in caught.value.problems), caught.value.problems


def test_every_problem_is_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load(write(tmp_path, heartbeat_interval=1), {})
    assert len(caught.value.problems) == 3  # no server_url, no api_key, interval


def test_an_unreadable_file_is_one_clear_problem(tmp_path):
    path = tmp_path / "agent-config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="agent-config.json"):
        load(path, {})


def test_model_scan_dirs_replace_the_defaults_but_data_models_and_the_model_cache_are_always_scanned(tmp_path):
    cfg = load(write(tmp_path, **BASE, data_dir=str(tmp_path), model_scan_dirs=["/srv/models"]), {})
    assert cfg.scanned_model_dirs == ("/srv/models", ALWAYS_SCANNED_MODEL_DIR, DEFAULT_MODEL_DIRS[0])
    cfg = load(
        None,
        {
            "HETEROFLOW_SERVER_URL": "http://h:1",
            "HETEROFLOW_AGENT_KEY": "k",
            "HETEROFLOW_AGENT_DATA_DIR": str(tmp_path),
            "HETEROFLOW_MODEL_SCAN_DIRS": "/a,/b",
            "HETEROFLOW_MODEL_CACHE_DIR": "/b",
        },
    )
    assert cfg.scanned_model_dirs == ("/a", "/b", ALWAYS_SCANNED_MODEL_DIR)


def test_model_cache_keys_are_checked_together(tmp_path):
    cfg = load(
        write(
            tmp_path,
            **BASE,
            data_dir=str(tmp_path),
            model_cache_dir="/srv/cache",
            model_cache_bytes=10 * 2**30,
            model_hub_url="http://mirror.lan/models/",
        ),
        {},
    )
    assert (cfg.model_cache_dir, cfg.model_cache_bytes, cfg.model_hub_url) == (
        "/srv/cache",
        10 * 2**30,
        "http://mirror.lan/models",
    )
    assert cfg.model_progress_seconds == 2.0
    with pytest.raises(ConfigError) as refused:
        load(
            write(
                tmp_path,
                **BASE,
                data_dir=str(tmp_path),
                model_cache_dir="cache",
                model_cache_bytes=-1,
                model_hub_url="ftp://mirror",
            ),
            {},
        )
    assert len(refused.value.problems) == 3
    assert any("model_cache_dir" in p for p in refused.value.problems)
    assert any("model_cache_bytes" in p for p in refused.value.problems)
    assert any("model_hub_url" in p for p in refused.value.problems)


def test_hf_endpoint_alone_names_a_hugging_face_compatible_mirror(tmp_path):
    environ = {"HETEROFLOW_SERVER_URL": "http://h:1", "HETEROFLOW_AGENT_KEY": "k"}
    environ["HETEROFLOW_AGENT_DATA_DIR"] = str(tmp_path)
    cfg = load(None, {**environ, "HF_ENDPOINT": "http://hf-mirror.lan/"})
    assert (cfg.model_hub_url, cfg.model_hub_api) == ("http://hf-mirror.lan", "huggingface")
    own = load(None, {**environ, "HF_ENDPOINT": "http://hf.lan", "HETEROFLOW_MODEL_HUB_URL": "http://m.lan"})
    assert (own.model_hub_url, own.model_hub_api) == ("http://m.lan", "manifest")  # the agent's own key wins
    assert load(None, environ).model_hub_api == "manifest"
    with pytest.raises(ConfigError, match="model_hub_api 'git' must be manifest or huggingface"):
        load(None, {**environ, "HETEROFLOW_MODEL_HUB_API": "git"})


def test_dash_means_no_file_even_when_the_default_exists(tmp_path, monkeypatch):
    from heteroflow_agent import config

    installed = write(tmp_path, **BASE, node_id="installed-node")
    monkeypatch.setattr(config, "DEFAULT_CONFIG_FILE", installed)
    env = {
        "HETEROFLOW_SERVER_URL": "http://127.0.0.1:3333",
        "HETEROFLOW_AGENT_KEY": "k",
        "HETEROFLOW_AGENT_DATA_DIR": str(tmp_path / "d"),
    }
    assert load(None, env).node_id == "installed-node"
    assert load(None, env | {"HETEROFLOW_AGENT_CONFIG": "-"}).node_id != "installed-node"


def test_too_many_labels_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="at most 48 labels"):
        load(write(tmp_path, **BASE, data_dir=str(tmp_path), labels={f"l{i}": "x" for i in range(49)}), {})


def test_engine_priorities_and_images_are_read_and_checked(tmp_path):
    path = write(
        tmp_path,
        **BASE,
        data_dir=str(tmp_path),
        engine_priorities={"SafeTensors": ["SGLang", "vllm"], "gguf": ["llama.cpp"]},
        engine_images={"hygon": {"vllm": "registry.local:5000/dcu/vllm"}, "nvidia": {"sglang": ""}},
    )
    cfg = load(path, {})
    assert cfg.engine_priorities == {"safetensors": ["sglang", "vllm"], "gguf": ["llama.cpp"]}
    assert cfg.engine_images == {"hygon": {"vllm": "registry.local:5000/dcu/vllm"}, "nvidia": {"sglang": ""}}


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"engine_priorities": {"gguf": "llama.cpp"}}, "engine_priorities must map model formats to lists"),
        ({"engine_priorities": {"gguf": []}}, "engine_priorities must map model formats to lists"),
        ({"engine_images": {"hygon": {"vllm": "registry.local/dcu/vllm:24.04"}}}, "without a tag"),
        ({"engine_images": {"hygon": "registry.local/dcu/vllm"}}, "engine_images must map vendors"),
    ],
)
def test_bad_engine_settings_are_refused_by_name(tmp_path, bad, says):
    with pytest.raises(ConfigError) as refused:
        load(write(tmp_path, **BASE, data_dir=str(tmp_path), **bad), {})
    assert says in str(refused.value)


def test_the_engine_interpreter_is_the_agents_own_unless_an_executable_python_is_named(tmp_path):
    import sys

    base = write(tmp_path, **BASE, data_dir=str(tmp_path))
    assert load(base, {}).engine_python == ""  # the agent's own (main: sys.executable)
    assert load(base, {"HETEROFLOW_ENGINE_PYTHON": sys.executable}).engine_python == sys.executable
    for bad in ("python3", str(tmp_path / "no-such-python"), str(base)):  # relative, missing, not executable
        with pytest.raises(ConfigError, match="engine_python .* must be the absolute path of an executable Python"):
            load(base, {"HETEROFLOW_ENGINE_PYTHON": bad})


def test_the_health_interval_is_read_and_bounded(tmp_path):
    env = {"HETEROFLOW_SERVER_URL": "http://cp:3333", "HETEROFLOW_AGENT_KEY": "k", "HETEROFLOW_NODE_ID": "n1"}
    assert load("-", env).health_interval == 30
    assert load("-", {**env, "HETEROFLOW_HEALTH_SECONDS": "120"}).health_interval == 120
    with pytest.raises(ConfigError, match="health_interval"):
        load("-", {**env, "HETEROFLOW_HEALTH_SECONDS": "1"})


def test_the_specs_name_for_the_interval_is_read_beside_todays(tmp_path):
    path = write(tmp_path, **BASE, data_dir=str(tmp_path / "data"))
    assert load(path, {"HETEROFLOW_HEARTBEAT_INTERVAL_SEC": "15"}).heartbeat_interval == 15
    both = {"HETEROFLOW_HEARTBEAT_INTERVAL": "10", "HETEROFLOW_HEARTBEAT_INTERVAL_SEC": "15"}
    assert load(path, both).heartbeat_interval == 10  # today's name, when both are set
    with pytest.raises(ConfigError, match="heartbeat_interval"):
        load(path, {"HETEROFLOW_HEARTBEAT_INTERVAL_SEC": "1"})


def test_a_variable_the_agent_does_not_read_is_named_with_what_it_likely_meant():
    environ = {
        "HETEROFLOW_HEARTBEAT_INTERVALS": "10",  # misspelt
        "HETEROFLOW_SERVER_URL": "http://cp:3333",  # read
        "HETEROFLOW_ADMIN_PASSWORD": "x",  # the server's, nothing like the agent's
        "PATH": "/usr/bin",
    }
    assert unknown_environment(environ) == [
        "HETEROFLOW_ADMIN_PASSWORD",
        "HETEROFLOW_HEARTBEAT_INTERVALS (HETEROFLOW_HEARTBEAT_INTERVAL?)",
    ]
    assert unknown_environment({"HETEROFLOW_LOG_RATE_BYTES": "1024", "HETEROFLOW_AGENT_CONFIG": "-"}) == []
