"""Settings layering (CLI > env > settings.json > defaults) and validation errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from omlx.errors import ConfigError
from omlx.settings import SETTINGS, load_settings, settings_table_markdown


def test_defaults_follow_omlx_home(omlx_home: Path):
    s = load_settings({}, env={"OMLX_HOME": str(omlx_home)})
    assert s.host == "127.0.0.1" and s.port == 8000 and s.max_concurrent_requests == 8
    assert s.model_dir == omlx_home / "models" and s.cache_dir == omlx_home / "cache"
    assert s.sources["port"] == "default"


def test_layering_cli_over_env_over_file_over_default(omlx_home: Path):
    (omlx_home / "settings.json").write_text(json.dumps({"port": 7001, "log_level": "debug", "host": "0.0.0.0"}))
    env = {"OMLX_PORT": "7002", "OMLX_LOG_LEVEL": "warning"}
    s = load_settings({"port": 7003}, env=env)
    assert (s.port, s.sources["port"]) == (7003, "cli")
    assert (s.log_level, s.sources["log_level"]) == ("warning", "env")
    assert (s.host, s.sources["host"]) == ("0.0.0.0", "file")
    assert s.sources["max_concurrent_requests"] == "default"


def test_bool_settings_from_env(omlx_home: Path):
    assert load_settings({}, env={"OMLX_NO_CACHE": "true"}).no_cache is True
    assert load_settings({}, env={"OMLX_NO_CACHE": "0"}).no_cache is False


@pytest.mark.parametrize(
    "cli, env, fragment",
    [
        ({}, {"OMLX_PORT": "eighty"}, "port (from OMLX_PORT)"),
        ({"log_level": "loud"}, {}, "choose one of"),
        ({"max_concurrent_requests": 0}, {}, "below the minimum"),
        ({}, {"OMLX_NO_CACHE": "maybe"}, "expected true or false"),
    ],
)
def test_invalid_values_name_the_setting_and_source(omlx_home: Path, cli, env, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_settings(cli, env=env)


def test_settings_file_errors(omlx_home: Path):
    (omlx_home / "settings.json").write_text("{not json")
    with pytest.raises(ConfigError, match="Cannot read"):
        load_settings({}, env={})
    (omlx_home / "settings.json").write_text(json.dumps({"prot": 1}))
    with pytest.raises(ConfigError, match="unknown settings: prot"):
        load_settings({}, env={})


def test_readme_settings_table_is_generated_from_settings():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert settings_table_markdown() in readme, "run: python -m omlx.docs to regenerate the README table"
    for s in SETTINGS:
        assert s.flag in readme and s.env in readme
