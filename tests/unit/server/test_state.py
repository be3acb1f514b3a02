"""The launcher's state file (triton_pipelines.server.state): one writer, one reader, one default folder."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from triton_pipelines.server.control import ControlClient
from triton_pipelines.server.state import STATE_ENV, ServerState, resolve_state_dir


def test_the_state_file_reads_back_what_was_written_and_only_its_owner_reads_it(tmp_path):
    state = ServerState(launcher_pid=7, triton_http="127.0.0.1:1", triton_grpc="127.0.0.1:2",
                        triton_metrics="127.0.0.1:3", replicas=[{"triton_http": "127.0.0.1:1",
                                                                 "triton_grpc": "127.0.0.1:2"}],
                        status="127.0.0.1:4", http_port=8000, grpc_port=8001, metrics_port=8002,
                        listen_address="0.0.0.0", model_repository="/models", shm_prefix="p_")
    state.write(tmp_path)
    assert ServerState.read(tmp_path) == state
    assert stat.S_IMODE((tmp_path / "server.json").stat().st_mode) == 0o600
    assert json.loads((tmp_path / "server.json").read_text())["triton_http"] == "127.0.0.1:1"  # the format tools read
    assert state.public_host == "localhost"


def test_a_partial_or_newer_state_file_still_reads(tmp_path):
    (tmp_path / "server.json").write_text(json.dumps({"triton_http": "127.0.0.1:9", "a_later_field": 1}))
    (tmp_path / "control.key").write_text("k" * 20 + "\n")
    assert ServerState.read(tmp_path).triton_http == "127.0.0.1:9"
    control = ControlClient.from_state(tmp_path)
    assert (control.http_url, control.key) == ("127.0.0.1:9", "k" * 20)


def test_the_state_folder_is_the_flag_then_the_environment_then_dot_triton_slash_the_port(monkeypatch, tmp_path):
    monkeypatch.delenv(STATE_ENV, raising=False)
    assert resolve_state_dir() == Path(".triton/8000") and resolve_state_dir(None, 9000) == Path(".triton/9000")
    monkeypatch.setenv(STATE_ENV, str(tmp_path))
    assert resolve_state_dir(None, 9000) == tmp_path
    assert resolve_state_dir(tmp_path / "given") == tmp_path / "given"
    with pytest.raises(RuntimeError, match="no running launcher found in"):
        ControlClient.from_state(tmp_path / "empty")
