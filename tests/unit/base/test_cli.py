"""The one command line (``python -m triton_pipelines``): its commands, and configuration errors at
start-up answered in one line naming the file or variable, the entry and the rule, exit 2, no
traceback (a keys file, a route table, an environment variable, a model that is not there)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from triton_pipelines.__main__ import COMMANDS

from tests.support.paths import PROJECT_ROOT


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "triton_pipelines", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=PROJECT_ROOT, timeout=120)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_every_command_names_a_module_with_main_and_answers_help():
    import importlib

    for command, (module, _) in COMMANDS.items():
        assert callable(importlib.import_module(module).main), command
    result = cli("--help")
    assert result.returncode == 0 and all(command in result.stdout for command in COMMANDS)
    assert cli("nope").returncode == 2


@pytest.fixture
def repository(tmp_path):
    """A built-looking repository with a router whose route table a test writes."""
    (tmp_path / ".built").write_text("{}")
    (tmp_path / "router" / "1").mkdir(parents=True)
    (tmp_path / "router" / "config.pbtxt").write_text('name: "router"\nbackend: "python"\n')
    return tmp_path


def test_a_bad_keys_file_is_one_line(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: short\n    name: team-a\n")
    line = one_line_error(cli("serve", "--model-repository", str(PROJECT_ROOT / "model_repository"),
                              env={"TRITON_API_KEYS_FILE": str(keys)}))
    assert str(keys) in line and "keys[0] (team-a)" in line and "16-512" in line


@pytest.mark.parametrize("text, expected", [
    ("tasks: [", "not a readable YAML file (line"),
    ("prices:\n  m: {input: 1}\ntasks: {}\n", "lacks its field 'output'"),
    ("tasks:\n  t: {route: sideways}\n", "route must be 'triton' or 'gateway'"),
])
def test_a_bad_route_table_is_one_line(repository, text, expected):
    (repository / "router" / "1" / "routes.yaml").write_text(text)
    line = one_line_error(cli("serve", "--model-repository", str(repository)))
    assert "routes.yaml" in line and expected in line, line


def test_a_bad_environment_variable_is_one_line():
    line = one_line_error(cli("serve", "--model-repository", str(PROJECT_ROOT / "model_repository"),
                              env={"TRITON_REPLICAS": "two"}))
    assert line.endswith("$TRITON_REPLICAS='two' must be a whole number")


def test_a_model_that_is_not_there_is_one_line():
    line = one_line_error(cli("serve", "--model-repository", str(PROJECT_ROOT / "model_repository"),
                              "--load-model", "text_embedding", "--load-model", "nope"))
    assert "--load-model nope: not in" in line and "text_embedding" in line
