"""The router's external route on a real embedded Triton server, over HTTP and gRPC, against the
local fake OpenAI-compatible server (tests/support/fake_gateway.py, real HTTP on 127.0.0.1).

This module starts its own small server: a repository with only the built ``router`` (its route
file with short time-outs), and LLM_GATEWAY_BASE_URL / LLM_GATEWAY_API_KEY pointing at the fake.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest
import yaml

from triton_pipelines.client import InferenceServerException, TritonClient
from triton_pipelines.server.launcher import start_on_free_ports

from tests.conftest import ensure_repository, gateway_environment
from tests.support.fake_gateway import Reply
from tests.support.router_helpers import metric, route, scrape
from tests.support.paths import PROJECT_ROOT

ROOT = PROJECT_ROOT
KEY = "sk-router-test-" + os.urandom(12).hex()
GATEWAY = {"timeout_s": 1.0, "max_retries": 2, "backoff_s": 0.05, "max_backoff_s": 0.2,
           "circuit_failure_threshold": 5, "circuit_reset_s": 2.0}


@pytest.fixture(scope="module")
def gateway_server(fake, tmp_path_factory):
    source = ensure_repository() / "router"  # the built router alone: no need for the session server
    repository = tmp_path_factory.mktemp("router-gateway-repo")
    shutil.copytree(source, repository / "router", ignore=shutil.ignore_patterns("splits.json"))
    routes = repository / "router" / "1" / "routes.yaml"
    document = yaml.safe_load(routes.read_text())
    document["gateway"].update(GATEWAY)
    routes.write_text(yaml.safe_dump(document))
    log = ROOT / ".cache" / "test-router-gateway-server.log"
    with gateway_environment(fake.base_url, KEY):
        server = start_on_free_ports(repository, log, timeout_s=120)
    yield server
    server.stop()
    assert KEY not in log.read_text(errors="replace"), "the API key appeared in the server log"


@pytest.fixture(scope="module", params=["http", "grpc"])
def gw(request, gateway_server) -> TritonClient:
    c = TritonClient(request.param, gateway_server.url(request.param))
    yield c
    c.close()


@pytest.fixture
def gateway(fake, gateway_server):
    """A fresh script, and a closed circuit (the breaker test leaves it open for a while)."""
    fake.reset()
    deadline = time.monotonic() + 10
    while True:
        try:
            route(TritonClient("http", gateway_server.http_url), "general_llm", {"text": "warm"})
            break
        except InferenceServerException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    fake.reset()
    return fake


@pytest.mark.parametrize("task, tier, model", [
    ("general_llm", None, "gemini-2.5-flash"), ("general_llm", "cheapest", "deepseek-v3.2"),
    ("general_llm", "balanced", "gemini-2.5-flash"), ("general_llm", "best", "claude-sonnet-4.5"),
    ("code_generation", "best", "claude-sonnet-4.5"), ("bulk_llm", "best", "gemini-2.5-flash"),
    ("vision_llm", "cheapest", "gemini-2.5-flash"),
])
def test_tier_chooses_the_model_sent_to_the_gateway(gw, gateway, task, tier, model):
    payload = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
               "temperature": 0.2, "max_tokens": 64}
    if tier:
        payload["tier"] = tier
    result = route(gw, task, payload)
    (sent,) = gateway.requests
    assert sent.body["model"] == model and sent.body["messages"] == payload["messages"]
    assert sent.body["temperature"] == 0.2 and sent.body["max_tokens"] == 64
    assert result["route"] == "gateway" and result["model"] == model and result["task"] == task
    assert result["output"] == {"text": f"echo:{model}:hello"}


def test_cost_is_exact_from_the_reported_usage(gw, gateway):
    gateway.script(Reply(prompt_tokens=1234, completion_tokens=567, content="four"))
    result = route(gw, "code_generation", {"text": "2+2?"})  # default claude-sonnet-4.5: 4.50 / 15.00
    expected = float((1234 * Decimal("4.50") + 567 * Decimal("15.00")) / 1_000_000)
    assert result["usage"] == {"input_tokens": 1234, "output_tokens": 567, "cost_usd": expected}
    assert expected == 0.014058 and result["output"] == {"text": "four"}


def test_key_is_sent_as_bearer_and_never_returned(gw, gateway):
    result = route(gw, "general_llm", {"text": "what is my key?"})
    assert gateway.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert KEY not in str(result)
    gateway.script(Reply(status=401, raw=f'{{"error": {{"message": "invalid api key {KEY}"}}}}'.encode()))
    with pytest.raises(InferenceServerException) as error:
        route(gw, "general_llm", {"text": "x"})
    assert "HTTP 401" in str(error.value) and KEY not in str(error.value)


def test_retries_429_and_5xx_then_succeeds(gw, gateway):
    gateway.script(Reply(status=429), Reply(status=502))
    result = route(gw, "bulk_llm", {"text": "retry me"})
    assert len(gateway.requests) == 3 and result["output"]["text"] == "echo:deepseek-v3.2:retry me"


def test_gateway_failures_are_clear_errors(gw, gateway):
    cases = [((Reply(status=500),) * 3, "HTTP 500", "after 3 attempts"),
             ((Reply(raw=b"<html>not json</html>"),), "could not be read", "task general_llm (gateway)"),
             ((Reply(completion_tokens=None),), "no usable token usage", "refused"),
             ((Reply(delay_s=1.5),) * 3, "did not answer within 1 s", "after 3 attempts")]
    for replies, *fragments in cases:
        gateway.default = replies[0]  # every model of general_llm's fallback chain fails the same way
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as error:
            route(gw, "general_llm", {"text": "x"})
        assert time.monotonic() - started < 6 * 3  # three models in the chain, each within the bound
        assert "models tried: gemini-2.5-flash" in str(error.value)
        assert all(f in str(error.value) for f in fragments), str(error.value)
        gateway.reset()
        route(gw, "general_llm", {"text": "ok again"})  # a failure leaves nothing behind
        gateway.reset()


def test_slow_gateway_does_not_hold_up_other_requests(gateway_server, gateway):
    gateway.script(Reply(delay_s=0.9, content="slow"))
    clients = [TritonClient("grpc", gateway_server.grpc_url) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(route, clients[0], "general_llm", {"text": "slow"})
        time.sleep(0.2)
        started = time.monotonic()
        fast = route(clients[1], "general_llm", {"text": "fast"})
        fast_s = time.monotonic() - started
        assert slow.result()["output"]["text"] == "slow"
    assert fast["output"]["text"] == "echo:gemini-2.5-flash:fast"
    assert fast_s < 0.5, f"the fast request waited {fast_s:.2f} s behind the slow one"


def test_circuit_opens_fails_fast_and_recovers(gateway_server, gateway):
    client = TritonClient("grpc", gateway_server.grpc_url)
    gateway.default = Reply(status=503)
    open_answers = 0
    for _ in range(40):  # two router instances, one breaker each: until both are open
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as error:
            route(client, "general_llm", {"text": "x"})
        if "circuit open" in str(error.value):
            assert time.monotonic() - started < 0.5
            open_answers += 1
            if open_answers == 4:
                break
        else:
            open_answers = 0
    assert open_answers == 4
    calls = len(gateway.requests)
    with pytest.raises(InferenceServerException, match="circuit open"):
        route(client, "general_llm", {"text": "x"})
    assert len(gateway.requests) == calls  # failing fast: the gateway saw nothing
    gateway.default = Reply()
    time.sleep(GATEWAY["circuit_reset_s"] + 0.2)
    assert route(client, "general_llm", {"text": "back"})["output"]["text"] == "echo:gemini-2.5-flash:back"


def test_gateway_metrics_count_tokens_cost_and_failures(gateway_server, gateway):
    client = TritonClient("http", gateway_server.http_url)
    before = scrape(gateway_server.metrics_url)
    gateway.script(Reply(prompt_tokens=1000, completion_tokens=200), Reply(prompt_tokens=500, completion_tokens=50))
    route(client, "general_llm", {"text": "a", "tier": "best"})  # claude-sonnet-4.5
    route(client, "general_llm", {"text": "b", "tier": "best"})
    gateway.default = Reply(status=500)  # claude-sonnet-4.5 and its fallbacks all fail
    with pytest.raises(InferenceServerException):
        route(client, "general_llm", {"text": "c", "tier": "best"})
    gateway.default = Reply()
    after = scrape(gateway_server.metrics_url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    model = {"model": "claude-sonnet-4.5"}
    assert delta("router_gateway_tokens_total", **model, direction="input") == 1500
    assert delta("router_gateway_tokens_total", **model, direction="output") == 250
    expected_cost = float((1500 * Decimal("4.50") + 250 * Decimal("15.00")) / 1_000_000)
    assert delta("router_gateway_cost_usd_total", **model) == pytest.approx(expected_cost, abs=1e-12)
    assert delta("router_requests_total", task="general_llm", route="gateway", outcome="success") == 2
    assert delta("router_requests_total", task="general_llm", route="gateway", outcome="error") == 1
    assert delta("router_failures_total", task="general_llm", route="gateway", reason="upstream_status") == 1
    assert delta("router_upstream_latency_seconds_count", task="general_llm", route="gateway") == 3
