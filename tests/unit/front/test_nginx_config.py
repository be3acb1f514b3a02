"""The nginx front's configuration (proxy.py, proxy_nginx.conf.template), without nginx: the text
rendered for several configurations is byte for byte the one in tests/data/nginx/, which the
f-string renderer wrote before the configuration moved into a template. A change to the front's
configuration changes these files on purpose (render them again and read the diff);
tests/unit/server/test_launcher.py checks with `nginx -t` that what is rendered is valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from triton_pipelines.front.nginx_config import ProxyConfig, render_config
from tests.support.paths import PROJECT_ROOT, TEST_DATA

EXPECTED = TEST_DATA / "nginx"


def config(**changes) -> ProxyConfig:
    values = dict(listen_address="0.0.0.0", http_port=8000, grpc_port=8001, metrics_port=8002,
                  triton_http_ports=(19000,), triton_grpc_ports=(19001,), screen_http_ports=(19004,),
                  screen_grpc_ports=(19005,), status_port=19002,
                  state_dir=Path("/srv/triton-state"))
    return ProxyConfig(**(values | changes))


TWO_REPLICAS = dict(triton_http_ports=(19000, 19010), triton_grpc_ports=(19001, 19011),
                    screen_http_ports=(19004, 19014), screen_grpc_ports=(19005, 19015))
CASES = {
    "one_replica": (config(), None),
    "two_replicas_ipv6_per_client_64_run_as": (
        config(listen_address="::1", max_inflight_per_client=64, run_as="nobody nogroup", **TWO_REPLICAS),
        Path("/tmp/triton-proxy-x")),
    "one_replica_per_client_64_limits": (
        config(listen_address="127.0.0.1", max_inflight_per_client=64, max_json_bytes=100_000,
               max_body_bytes=32 * 2**20 + 512, max_inflight=10, workers=2, upstream_timeout_s=30), None),
    "two_replicas_run_as": (config(run_as="triton-server", **TWO_REPLICAS), Path("/tmp/triton-proxy-y")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_config_is_the_expected_text(name):
    proxy_config, temp_dir = CASES[name]
    assert render_config(proxy_config, temp_dir) == (EXPECTED / f"{name}.conf").read_text()


def test_the_template_ships_in_the_package():
    """The images install the package non-editable: the template must be package data."""
    import tomllib

    from triton_pipelines.front import nginx_config as proxy

    package = Path(proxy.__file__).parent
    patterns = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["triton_pipelines.front"]
    assert any(proxy.TEMPLATE in package.glob(pattern) for pattern in patterns)


def test_every_template_field_is_filled_and_every_message_is_used():
    from triton_pipelines.front.nginx_config import HTTP_MESSAGES, MESSAGES, OPENAI_ERRORS, TEMPLATE, NginxTemplate

    text = TEMPLATE.read_text()
    fields = {m.group("named") or m.group("braced") for m in NginxTemplate.pattern.finditer(text)}
    rendered = render_config(config(max_inflight_per_client=1))
    assert "%%" not in rendered
    used = {f[len("json_"):] if f.startswith("json_") and f[len("json_"):] in HTTP_MESSAGES else f for f in fields}
    used |= {OPENAI_ERRORS[f[len("openai_error_"):]][0] for f in fields if f.startswith("openai_error_")}
    assert set(MESSAGES) - used == {"grpc_overloaded_per_client"}  # chosen as grpc_overloaded


def test_the_body_limit_is_the_largest_legal_input():
    """The front's default body limit is the speech pipeline's audio limit (the largest input a model
    accepts; audio_features' config holds the same number, tests/unit/pipelines/test_input_budgets.py)."""
    from triton_pipelines.front.nginx_config import DEFAULT_MAX_BODY_BYTES
    from triton_pipelines.limits import MAX_AUDIO_BYTES

    assert DEFAULT_MAX_BODY_BYTES == MAX_AUDIO_BYTES


def test_a_down_v1_frontend_is_named_as_such():
    """When the /v1 frontend is down nginx answers /v1 (and /v1/health) with a 503 in OpenAI's shape
    that names it, not the inference server: the native API is still up (issue 33 §3)."""
    from triton_pipelines.front.nginx_config import MESSAGES

    text = render_config(config())
    for unavailable in text.split("location @openai_unavailable")[1:]:
        assert MESSAGES["openai_unavailable"] in unavailable.split("}", 2)[0] + "}"
    assert "/v1 frontend" in MESSAGES["openai_unavailable"]


def test_the_gate_is_a_unix_socket_in_the_workers_temp_folder_and_a_too_long_folder_is_one_line():
    from triton_pipelines.errors import ConfigError
    from triton_pipelines.front.nginx_config import MAX_SOCKET_PATH, gate_socket

    text = render_config(config(), Path("/tmp/triton-proxy-z"))
    assert text.count("unix:/tmp/triton-proxy-z/gate.sock") == 2  # the gate listens there; the public server sends there
    assert "%%" not in text and "127.0.0.1:19003" not in text
    folder = Path("/") / ("d" * (MAX_SOCKET_PATH - len("/gate.sock") - 1))
    assert len(str(gate_socket(folder))) == MAX_SOCKET_PATH
    with pytest.raises(ConfigError, match="too long a path for nginx's gate socket .*choose a shorter --state-dir") as error:
        gate_socket(folder / "x")
    assert "\n" not in str(error.value)
