"""The launcher's side of the OpenAI-compatible frontend (openai_process.py), without a server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from triton_pipelines.gateway.keys import KeysFileError
from triton_pipelines.server.frontend_process import FrontendProcess


def test_a_named_keys_file_that_is_missing_or_malformed_stops_the_start(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_API_KEYS_FILE", str(tmp_path / "absent.yaml"))
    with pytest.raises(KeysFileError):
        FrontendProcess(Path("model_repository"), ["127.0.0.1:1"], print)
    bad = tmp_path / "bad.yaml"
    bad.write_text("keys: [{key: short, name: a}]\n")
    monkeypatch.setenv("TRITON_API_KEYS_FILE", str(bad))
    with pytest.raises(KeysFileError):
        FrontendProcess(Path("model_repository"), ["127.0.0.1:1"], print)


def test_a_frontend_that_keeps_dying_is_restarted_with_backoff(monkeypatch):
    monkeypatch.delenv("TRITON_API_KEYS_FILE", raising=False)
    lines = []
    frontend = FrontendProcess(Path("model_repository"), ["127.0.0.1:1"], lines.append)
    frontend.command = lambda: [sys.executable, "-c", "raise SystemExit(3)"]
    frontend.start()
    frontend.process.wait()
    assert frontend.ensure_running()  # the first exit: at once
    frontend.process.wait()
    assert not frontend.ensure_running()  # dying again at once: after a backoff
    assert frontend.restarts == 1 and "restarting it in 2 s" in lines[-1]
    frontend.next_start = 0.1  # the backoff has passed
    assert frontend.ensure_running() and frontend.restarts == 2
    frontend.process.wait()
    assert "launcher_openai_frontend_restarts_total 2" in frontend.metrics_text()


def test_the_replicas_http_ports_are_passed_one_per_replica(monkeypatch):
    monkeypatch.delenv("TRITON_API_KEYS_FILE", raising=False)
    frontend = FrontendProcess(Path("model_repository"), ["127.0.0.1:1", "127.0.0.1:2"], print,
                               triton_http=["127.0.0.1:3", "127.0.0.1:4"])
    command = frontend.command()
    assert [a for a in command if a.startswith("--triton-")] == [
        "--triton-grpc=127.0.0.1:1", "--triton-grpc=127.0.0.1:2", "--triton-http=127.0.0.1:3", "--triton-http=127.0.0.1:4"]
    assert not any(a.startswith("--triton-http") for a in FrontendProcess(Path("model_repository"), ["127.0.0.1:1"],
                                                                          print).command())
    with pytest.raises(ValueError):
        FrontendProcess(Path("model_repository"), ["127.0.0.1:1", "127.0.0.1:2"], print, triton_http=["127.0.0.1:3"])
