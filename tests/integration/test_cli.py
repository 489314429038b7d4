"""The `omlx` command line as a user runs it: one-line errors, diagnose, models list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def omlx(*args: str, home: Path, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omlx", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMLX_HOME": str(home), "COLUMNS": "200", **(env or {})},
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in result.stderr


@pytest.mark.parametrize(
    "args, env, fragments",
    [
        (["serve", "--port", "eighty"], {}, ["--port"]),
        (["serve", "--log-level", "loud"], {}, ["log-level"]),
        (["serve"], {"OMLX_MAX_CONCURRENT_REQUESTS": "0"}, ["max_concurrent_requests", "OMLX_MAX_CONCURRENT_REQUESTS"]),
        (["serve", "--hot-cache-max-size", "lots"], {}, ["hot_cache_max_size"]),
    ],
)
def test_bad_flag_values_are_one_line_errors(tmp_path, args, env, fragments):
    assert_one_line_error(omlx(*args, home=tmp_path, env=env), *fragments)


def test_model_dir_that_is_a_file_is_a_one_line_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result = omlx("serve", "--model-dir", str(not_a_dir), home=tmp_path)
    assert_one_line_error(result, "not a folder")


def test_unusable_model_dir_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")  # a file: nothing can be created below it, even by root
    result = omlx("serve", "--model-dir", str(blocker / "models"), home=tmp_path, timeout=60)
    assert_one_line_error(result, "not usable")


def test_diagnose_reports_platform_device_memory_and_models(tiny_model_dir, tmp_path):
    result = omlx("diagnose", "--json", home=tmp_path, env={"OMLX_MODEL_DIR": str(tiny_model_dir)})
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    for key in ("platform", "python", "mlx", "mlx_lm", "device", "total_bytes", "available_bytes",
                "model_dir", "cache_dir", "models", "blas", "compute_dtype"):
        assert key in info
    assert info["models"] == ["tiny-llama"]
    assert info["model_dir"] == str(tiny_model_dir)


def test_models_list_shows_models_and_reports_malformed_folders(tiny_model_dir, tmp_path):
    broken = tmp_path / "models"
    (broken / "half-model").mkdir(parents=True)
    (broken / "half-model" / "config.json").write_text("{}")
    (broken / "half-model" / "model.safetensors").write_bytes(b"")
    result = omlx("models", "list", "--model-dir", str(broken), home=tmp_path)
    assert result.returncode == 0
    assert "half-model" in result.stdout and "tokenizer" in result.stdout
    result = omlx("models", "list", "--model-dir", str(tiny_model_dir), home=tmp_path)
    assert "tiny-llama\tllm\tctx=2048" in result.stdout
    result = omlx("models", "list", "--model-dir", str(tmp_path / "absent"), home=tmp_path)
    assert_one_line_error(result, "does not exist")


def test_serve_help_is_one_line_per_flag_at_80_columns(tmp_path):
    from omlx.settings import SETTINGS

    result = omlx("serve", "--help", home=tmp_path, env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    for s in SETTINGS:
        assert s.summary, f"{s.name} has no summary"
        mine = [line for line in lines if line.split()[:1] == [s.flag]]
        assert len(mine) == 1 and mine[0].endswith(s.summary), (s.flag, mine)


# A real `omlx serve` whose package metadata lacks MLX's Linux backends (as after `pip install omlx`
# without an extra): the error names the extra with its brackets.
WITHOUT_BACKEND = """
import importlib.metadata as md, sys
from omlx.platform_info import LINUX_BACKENDS
real = md.version
def version(name):
    if name in LINUX_BACKENDS:
        raise md.PackageNotFoundError(name)
    return real(name)
md.version = version
sys.argv = ["omlx", "serve"]
from omlx.cli import main
main()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the backend extras exist on Linux only")
def test_errors_reach_the_terminal_verbatim(tmp_path):
    result = subprocess.run([sys.executable, "-c", WITHOUT_BACKEND], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "OMLX_HOME": str(tmp_path), "COLUMNS": "80"})
    assert_one_line_error(result, "pip install 'omlx[cpu]'", "pip install 'omlx[cuda]'")
    assert len(result.stderr.strip().splitlines()) == 1
