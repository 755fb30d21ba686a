"""The config file: where it is, its modes, profiles, and what overrides what."""

from __future__ import annotations

import stat

import pytest
from hf_fakeapi import KEY

from heteroflow_client import config
from heteroflow_client.errors import AuthError


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_file_is_under_xdg_config_home_mode_600_in_a_700_folder(home):
    path = config.save_profile("default", "http://a:3333/", "sk-tenant-a")
    assert path == home / "config" / "heteroflow" / "config.toml"
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert config.read_file() == {
        "default_profile": "default",
        "profiles": {"default": {"url": "http://a:3333", "key": "sk-tenant-a"}},
    }


def test_without_xdg_config_home_it_is_under_the_home_folder(home, monkeypatch):
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert config.config_path() == home / ".config" / "heteroflow" / "config.toml"


def test_a_folder_too_open_is_closed_and_the_file_stays_600_when_rewritten(home):
    folder = home / "config" / "heteroflow"
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    path = config.save_profile("a", "http://a", "k1")
    path.chmod(0o644)  # someone loosened it: the next write makes it private again
    config.save_profile("b", "http://b", "k2")
    assert mode(folder) == 0o700 and mode(path) == 0o600


def test_profiles_the_first_is_the_default_and_any_may_be_named(home, monkeypatch):
    config.save_profile("lab", "http://lab:3333", "sk-tenant-lab")
    config.save_profile("prod", "https://prod", "sk-admin-prod")
    assert config.resolve().profile == "lab"
    assert (config.resolve().url, config.resolve().key) == ("http://lab:3333", "sk-tenant-lab")
    assert config.resolve(profile="prod").key == "sk-admin-prod"
    monkeypatch.setenv("HETEROFLOW_PROFILE", "prod")
    assert config.resolve().url == "https://prod"
    assert config.resolve(profile="lab").url == "http://lab:3333"  # the argument wins
    config.save_profile("prod", "https://prod2", "k", make_default=True)
    monkeypatch.delenv("HETEROFLOW_PROFILE")
    assert config.resolve().url == "https://prod2"


def test_the_environment_overrides_the_stored_url_and_key(home, monkeypatch):
    config.save_profile("default", "http://stored", "sk-stored")
    monkeypatch.setenv("HETEROFLOW_URL", "http://from-env")
    assert (config.resolve().url, config.resolve().key) == ("http://from-env", "sk-stored")
    monkeypatch.setenv("HETEROFLOW_API_KEY", "sk-from-env")
    assert config.resolve().key == "sk-from-env"
    assert config.resolve(key="sk-argument").key == "sk-argument"


def test_nothing_configured_says_to_log_in(home):
    with pytest.raises(AuthError, match="hf login"):
        config.resolve().require()


def test_values_with_quotes_backslashes_and_unicode_round_trip(home):
    tricky = 'http://h/"quoted"\\back\tslash/ünï'
    config.save_profile('odd "name"', tricky, "sk-\n-key")
    assert config.resolve(profile='odd "name"').url == tricky.rstrip("/")
    assert config.resolve(profile='odd "name"').key == "sk-\n-key"


def test_an_unknown_named_profile_is_an_error(home):
    config.save_profile("lab", "http://lab", "k")
    with pytest.raises(Exception, match="no profile 'nope'"):
        config.resolve(profile="nope")


def test_hf_login_checks_the_key_then_saves_it_and_prompts_for_it(home, fakeapi):
    from click.testing import CliRunner

    from heteroflow_client.cli import cli

    runner = CliRunner()
    refused = runner.invoke(cli, ["login", "--url", fakeapi.url], input="sk-tenant-wrong\n")
    assert refused.exit_code == 2 and "hf login" in refused.stderr
    assert not config.config_path().exists()  # a refused key is not saved
    done = runner.invoke(cli, ["login", "--url", fakeapi.url, "--profile", "lab"], input=KEY + "\n")
    assert done.exit_code == 0, done.stderr
    assert "alice" in done.stdout and "acme" in done.stdout
    assert KEY not in done.stdout  # the hidden prompt does not echo it
    assert config.resolve().profile == "lab" and config.resolve().key == KEY
    assert mode(config.config_path()) == 0o600
    who = runner.invoke(cli, ["whoami", "-o", "json"])
    assert who.exit_code == 0 and '"username": "alice"' in who.stdout
    assert fakeapi.got("GET", "/api/v1/me")[-1].headers["authorization"] == f"Bearer {KEY}"
