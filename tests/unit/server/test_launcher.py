"""The launcher without a server: its options, ports and the start-up checks (the launcher serving:
tests/server/test_launcher.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from triton_pipelines.errors import ConfigError
from triton_pipelines.server import launcher, serve_cli
from triton_pipelines.server.launcher import InternalPorts, ServerOptions, server_command

from tests.conftest import ensure_repository

def test_ports_come_from_flags_then_environment_then_defaults(monkeypatch):
    monkeypatch.setenv("TRITON_HTTP_PORT", "9100")
    assert serve_cli._port(None, "TRITON_HTTP_PORT", 8000) == 9100
    assert serve_cli._port(9200, "TRITON_HTTP_PORT", 8000) == 9200
    monkeypatch.delenv("TRITON_HTTP_PORT")
    assert serve_cli._port(None, "TRITON_HTTP_PORT", 8000) == 8000


def test_server_command_loads_every_model_in_explicit_mode_on_loopback_with_restricted_control():
    command = server_command(ServerOptions(model_repository=Path("repo"), backend_dir=Path("b"),
                                           http_port=1, grpc_port=2, metrics_port=3),
                             InternalPorts(11, 12, 13), key="k" * 20, shm_prefix="p_")
    assert "--model-control-mode=explicit" in command and "--load-model=*" in command
    # Triton itself listens on its own loopback ports; nginx owns the public ones (1, 2, 3).
    assert {"--http-port=11", "--grpc-port=12", "--metrics-port=13", "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"} <= set(command)
    apis = "model-repository,shared-memory,logging,trace:triton-control-key=" + "k" * 20
    assert f"--http-restricted-api={apis}" in command and f"--grpc-restricted-protocol={apis}" in command
    assert "--backend-config=python,shm-region-prefix-name=p_" in command
    # no gRPC request/response objects kept for reuse: each held its last (up to 64 MiB) message
    assert "--grpc-infer-allocation-pool-size=0" in command
    # the screen's headers that reach the models as request parameters: the key id, the gRPC
    # deadline, every request's id on the cancel board (cancel_board.py)
    import re

    from triton_pipelines.gateway.keys import KEY_ID_PARAMETER
    from triton_pipelines.limits import CLIENT_CANCEL_PARAMETER, CLIENT_DEADLINE_PARAMETER

    patterns = {arg.split("=", 1)[0]: re.compile(arg.split("=", 1)[1]) for arg in command
                if arg.startswith(("--http-header-forward-pattern=", "--grpc-header-forward-pattern="))}
    forwarded = {flag: {name for name in (KEY_ID_PARAMETER, CLIENT_DEADLINE_PARAMETER, CLIENT_CANCEL_PARAMETER,
                                          "authorization", "x-client-cancel-idx") if pattern.search(name)}
                 for flag, pattern in patterns.items()}
    assert forwarded == {"--http-header-forward-pattern": {KEY_ID_PARAMETER, CLIENT_CANCEL_PARAMETER},
                         "--grpc-header-forward-pattern": {KEY_ID_PARAMETER, CLIENT_DEADLINE_PARAMETER,
                                                           CLIENT_CANCEL_PARAMETER}}


def test_unload_layers_put_callers_before_the_models_they_call():
    from triton_pipelines.server.drain import dependencies, unload_layers

    ensemble = {"ensemble_scheduling": {"step": [{"model_name": "tok"}, {"model_name": "enc"}]}}
    router = {"parameters": {"bls_dependencies": {"string_value": "*"}}}
    decoder_loop = {"parameters": {"bls_dependencies": {"string_value": "dec, enc"}}}
    calls = {"router": dependencies(router), "embed": dependencies(ensemble), "tok": set(), "enc": set(),
             "loop": dependencies(decoder_loop), "dec": set()}
    assert calls["embed"] == {"tok", "enc"} and calls["loop"] == {"dec", "enc"}
    assert unload_layers(calls) == [["router"], ["embed", "loop"], ["dec", "enc", "tok"]]


def test_json_header_limit_pattern_matches_exactly_the_numbers_up_to_the_limit():
    import re

    from triton_pipelines.front.nginx_config import regex_at_most

    for limit in (0, 1, 9, 10, 99, 100, 1234, 131072):
        pattern = re.compile(regex_at_most(limit))
        for n in list(range(0, 2000)) + [limit - 1, limit, limit + 1, 10 * limit + 7]:
            assert bool(pattern.match(str(n))) == (0 <= n <= limit), (limit, n)
        assert pattern.match("000" + str(limit)) and not pattern.match("") and not pattern.match("12a")


def test_generated_nginx_config_is_valid_and_listens_where_asked(tmp_path):
    import subprocess

    from triton_pipelines.front.nginx_config import ProxyConfig, render_config
    from triton_pipelines.server.nginx_process import nginx_binary

    for address in ("127.0.0.1", "0.0.0.0"):
        config = ProxyConfig(listen_address=address, http_port=18000, grpc_port=18001, metrics_port=18002,
                             triton_http_ports=(19000, 19010), triton_grpc_ports=(19001,), status_port=19002,
                             screen_http_ports=(19004, 19014), screen_grpc_ports=(19005, 19015),
                             max_inflight_per_client=64,
                             state_dir=tmp_path)
        text = render_config(config)
        assert f"listen {address}:18000 " in text and f"listen {address}:18001 http2 " in text
        assert "server 127.0.0.1:19000 max_fails=0;" in text and "server 127.0.0.1:19010 max_fails=0;" in text
        assert "client_max_body_size 131072;" in text
        # the HTTP gate (inference and /v1); gRPC requests are counted in the screens (front/places.py)
        assert text.count("limit_conn inflight 256;") == 1
        # one client's share: both HTTP infer locations (JSON and binary), /v1, and its gRPC ModelInfer
        # and ModelStreamInfer streams
        assert text.count("limit_conn perclient 64;") == 5
        # a stream waits for its answers with nothing flowing: only the upstream timeout cuts it
        stream = text.split("location = /inference.GRPCInferenceService/ModelStreamInfer {")[1].split("}", 2)[1]
        assert "client_body_timeout 300s;" in stream
        assert "grpc_set_header x-triton-pipelines-client $remote_addr;" in text
        # inference goes through the request screens, round robin like the replicas
        assert "server 127.0.0.1:19004 max_fails=0;" in text and "server 127.0.0.1:19015 max_fails=0;" in text
        assert "proxy_pass http://screen_http;" in text and "grpc_pass grpc://screen_grpc;" in text
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / "nginx.conf").write_text(text)
        check = subprocess.run([nginx_binary(), "-t", "-q", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


def test_control_key_comes_from_the_environment_or_is_generated(monkeypatch):
    from triton_pipelines.server.control import KEY_ENV, resolve_key

    monkeypatch.delenv(KEY_ENV, raising=False)
    first, second = resolve_key(), resolve_key()
    assert first != second and len(first) >= 32
    monkeypatch.setenv(KEY_ENV, "operator-chosen-key-0123")
    assert resolve_key() == "operator-chosen-key-0123"
    monkeypatch.setenv(KEY_ENV, "short:bad")
    with pytest.raises(ValueError, match="16 to 256 characters"):
        resolve_key()


def test_an_in_flight_limit_below_one_is_refused_at_start(capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["--model-repository", str(ensure_repository()), "--max-inflight", "0"])
    assert exit_info.value.code == 2
    assert "--max-inflight must be at least 1" in capsys.readouterr().err


def test_the_start_up_log_prints_the_model_table(tmp_path):
    from triton_pipelines.repository.contract import BuiltManifest, Provenance

    random_row = Provenance(kind="random", source="seed 0", architecture="bert-base-uncased").row("bert_base_encoder")
    BuiltManifest(model_table=[random_row]).write(tmp_path)
    lines = []
    launcher.log_model_table(tmp_path, lines.append)
    assert len(lines) == 1 and lines[0].startswith("WARNING: bert_base_encoder serves RANDOM WEIGHTS")
    launcher.log_model_table(tmp_path / "unbuilt", lines.append)
    assert len(lines) == 1


def test_the_response_cache_is_on_by_default_sized_by_flag_or_environment_and_off_at_zero(monkeypatch, capsys):
    from triton_pipelines.limits import DEFAULT_RESPONSE_CACHE_BYTES, RESPONSE_CACHE_ENV
    from triton_pipelines.server.tritonserver import pytriton_dir

    def flags(**options):
        command = server_command(ServerOptions(model_repository=Path("repo"), backend_dir=Path("b"), **options),
                                 InternalPorts(11, 12, 13), key="k" * 20, shm_prefix="p_")
        return [arg for arg in command if arg.startswith("--cache-")]

    # the embedded binary finds the wheel's local cache; the container's its own /opt/tritonserver/caches
    assert flags() == [f"--cache-config=local,size={DEFAULT_RESPONSE_CACHE_BYTES}",
                       f"--cache-directory={pytriton_dir() / 'caches'}"]
    assert (pytriton_dir() / "caches" / "local" / "libtritoncache_local.so").is_file()
    assert flags(tritonserver=Path("/opt/tritonserver/bin/tritonserver"), response_cache_bytes=1 << 20) == [
        "--cache-config=local,size=1048576"]
    assert flags(response_cache_bytes=0) == []

    repository = str(ensure_repository())
    monkeypatch.setenv(RESPONSE_CACHE_ENV, "0")
    assert serve_cli.parse_options(["--model-repository", repository]).response_cache_bytes == 0
    monkeypatch.setenv(RESPONSE_CACHE_ENV, str(64 << 20))
    assert serve_cli.parse_options(["--model-repository", repository]).response_cache_bytes == 64 << 20
    assert serve_cli.parse_options(["--model-repository", repository,
                                    "--response-cache-bytes", str(8 << 20)]).response_cache_bytes == 8 << 20
    monkeypatch.delenv(RESPONSE_CACHE_ENV)
    assert serve_cli.parse_options(["--model-repository", repository]).response_cache_bytes == DEFAULT_RESPONSE_CACHE_BYTES
    for bad in ("-1", "100"):
        with pytest.raises(SystemExit):
            serve_cli.parse_options(["--model-repository", repository, "--response-cache-bytes", bad])
        assert "--response-cache-bytes must be 0 (off) or at least 1048576" in capsys.readouterr().err
    monkeypatch.setenv(RESPONSE_CACHE_ENV, "lots")
    with pytest.raises(ConfigError, match=f"\\${RESPONSE_CACHE_ENV}='lots' must be a whole number"):
        serve_cli.parse_options(["--model-repository", repository])


def test_tritonserver_traces_only_when_an_otlp_endpoint_is_set(monkeypatch):
    def command():
        return server_command(ServerOptions(model_repository=Path("repo"), backend_dir=Path("b")),
                              InternalPorts(11, 12, 13), key="k" * 20, shm_prefix="p_")

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert not [flag for flag in command() if flag.startswith("--trace-config")]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    flags = [flag for flag in command() if flag.startswith("--trace-config")]
    assert "--trace-config=mode=opentelemetry" in flags and "--trace-config=rate=0" in flags
    assert "--trace-config=opentelemetry,url=http://collector:4318/v1/traces" in flags


def test_a_bad_otel_variable_is_one_line_before_anything_starts(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "2")
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER_ARG"):
        launcher.check_tracing()
