"""Router logic without a server: request validation, canary splits and the split file, circuit
breaker, and the gateway client against the local fake OpenAI-compatible server (real HTTP on
127.0.0.1). The route table itself: tests/unit/repository/test_routes.py."""

from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import os
import socket
import time

import numpy as np
import pytest

from triton_pipelines.errors import InputError, RouteError
from triton_pipelines.gateway.upstream import API_KEY_ENV, BASE_URL_ENV, CircuitBreaker, GatewayClient, retry_after_s
from triton_pipelines.pipelines.router.canary import SplitFile, choose_version, split_point
from triton_pipelines.pipelines.router.router import Router, tensor_to_json
from triton_pipelines.repository.routes import GatewaySettings, RouteTable

from tests.support.fake_gateway import Reply
from tests.support.paths import PROJECT_ROOT

ROOT = PROJECT_ROOT
ROUTES = ROOT / "data" / "routes.yaml"


@pytest.fixture(scope="module")
def table() -> RouteTable:
    return RouteTable.load(ROUTES)


@pytest.fixture(scope="module")
def router(table) -> Router:
    return Router(table)


@pytest.mark.parametrize("task, payload, cls, message", [
    ("translate", {"text": "x"}, None, "unknown task 'translate'; known tasks: bulk_llm, code_generation"),
    ("text_embedding", "{not json", None, "payload is not valid JSON"),
    ("text_embedding", [1, 2], None, "payload must be a JSON object, not list"),
    ("text_embedding", {"txt": "x"}, None, "needs payload field 'text'"),
    ("text_embedding", {"text": 5}, None, "payload field 'text' must be a string, not int"),
    ("text_embedding", {"text": "x"}, "fast", "latency_class must be one of realtime, batch"),
    ("image_classification", {"image": "***"}, None, "payload field 'image' is not valid base64"),
    ("general_llm", {"prompt": "x"}, None, "needs 'messages' (a list) or 'text'"),
    ("general_llm", {"messages": [{"role": "robot", "content": "x"}]}, None, "'messages'[0] must be an object"),
    ("general_llm", {"text": "x", "tier": "premium"}, None, "'tier' must be one of cheapest, balanced, best"),
    ("general_llm", {"text": "x", "max_tokens": "9"}, None, "'max_tokens' must be an integer, not str"),
    ("general_llm", {"text": "x", "temperature": 7}, None, "'temperature' must be between 0.0 and 2.0"),
])
def test_bad_requests_get_clear_errors(router, task, payload, cls, message):
    raw = payload if isinstance(payload, str) else json.dumps(payload)
    with pytest.raises(InputError, match=None) as error:
        router.prepare(task.encode(), raw.encode(), None if cls is None else cls.encode())
    assert message in str(error.value)


def test_oversized_payload_is_refused_before_parsing(table):
    small = Router(RouteTable(table.tasks, table.prices, table.gateway, table.canaries, max_payload_bytes=100))
    with pytest.raises(InputError, match="payload is 113 bytes; the limit is 100 bytes"):
        small.prepare(b"text_embedding", json.dumps({"text": "a" * 101}).encode())


def test_triton_route_names_the_variant_and_decodes_base64(router):
    routed = router.prepare(b"image_classification", json.dumps({"image": base64.b64encode(b"\x89PNG..").decode()}),
                            b"batch")
    assert (routed.target, routed.model, routed.latency_class) == ("image_classification_batch",
                                                                   "image_classification", "batch")
    assert routed.inputs["image"].tolist() == [[b"\x89PNG.."]] and routed.inputs["image"].dtype == np.object_
    assert routed.outputs == ("labels", "scores", "class_ids")


def test_split_points_are_sticky_and_uniform():
    assert split_point("t", "user-1") == split_point("t", "user-1")
    shares = [choose_version({1: 90, 2: 10}, split_point("text_embedding", f"k{i}")) for i in range(20000)]
    assert abs(shares.count(2) / len(shares) - 0.10) < 0.01
    # Growing the canary keeps its users on it (cumulative ranges in version order).
    for i in range(2000):
        point = split_point("t", f"k{i}")
        if choose_version({1: 90, 2: 10}, point) == 2:
            assert choose_version({1: 50, 2: 50}, point) == 2
    assert choose_version({1: 0, 2: 1}, 0.0) == 2 and choose_version({1: 1, 2: 0}, 0.9999) == 1


def test_split_file_overrides_defaults_when_it_changes(table, tmp_path):
    path = tmp_path / "splits.json"
    splits = SplitFile(path, table.canaries)
    assert splits.split("text_encoder") == {1: 90.0, 2: 10.0}  # the route file's default
    path.write_text(json.dumps({"text_encoder": {"1": 50, "2": 50}}))
    assert splits.split("text_encoder") == {1: 50.0, 2: 50.0}
    path.write_text(json.dumps({"text_encoder": {"3": 100}}))  # invalid: keeps the last valid split
    assert splits.split("text_encoder") == {1: 50.0, 2: 50.0} and "needs versions among [1, 2]" in splits.error
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    path.write_text(json.dumps({"text_encoder": {"1": 0, "2": 1}}))
    assert splits.split("text_encoder") == {1: 0.0, 2: 1.0} and splits.error == ""
    path.unlink()
    assert splits.split("text_encoder") == {1: 90.0, 2: 10.0}


def test_circuit_breaker_opens_fails_fast_and_half_opens():
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=3, reset_s=10, clock=lambda: now[0])
    for _ in range(2):
        breaker.record_failure()
    assert breaker.allow() and breaker.state == "closed"
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow()
    now[0] = 10.5
    assert breaker.allow() and not breaker.allow()  # one trial call only
    breaker.record_failure()  # the trial failed: open again
    assert breaker.state == "open"
    now[0] = 21
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow()


def test_tensor_to_json_drops_the_batch_axis():
    assert tensor_to_json(np.array([[b"refund"]], dtype=np.object_)) == "refund"
    assert tensor_to_json(np.array([[0.5]], dtype=np.float32)) == 0.5
    assert tensor_to_json(np.array([[1.0, 2.0]], dtype=np.float32)) == [1.0, 2.0]
    assert tensor_to_json(np.array([[b"a", b"b"]], dtype=np.object_)) == ["a", "b"]


# --------------------------------------------------------------------------- gateway client, real HTTP
KEY = "sk-unit-" + os.urandom(8).hex()
FAST = GatewaySettings(timeout_s=0.5, deadline_s=5.0, max_retries=2, backoff_s=0.01, circuit_failure_threshold=3,
                       circuit_reset_s=0.3)


@pytest.fixture
def gateway_client(fake):
    fake.reset()
    return GatewayClient(FAST, {BASE_URL_ENV: fake.base_url, API_KEY_ENV: KEY})


def routed_for(router, payload, task="general_llm"):
    return router.prepare(task.encode(), json.dumps(payload).encode())


def complete(client, routed, deadline_s=None):
    """One call on a fresh event loop (the async HTTP client belongs to the loop it ran on)."""
    async def once():
        try:
            return await client.complete(routed, deadline_s)
        finally:
            await client.close()

    return asyncio.run(once())


def test_gateway_sends_the_key_only_as_bearer_and_never_shows_it(router, fake, gateway_client):
    completion = complete(gateway_client, routed_for(router, {"text": "hello", "tier": "cheapest"}))
    assert completion.text == "echo:deepseek-v3.2:hello" and (completion.input_tokens, completion.output_tokens) == (11, 7)
    (request,) = fake.requests
    assert request.path == "/v1/chat/completions" and request.headers["authorization"] == f"Bearer {KEY}"
    assert request.body["model"] == "deepseek-v3.2" and request.body["max_tokens"] == 512
    assert KEY not in repr(gateway_client)
    fake.script(Reply(status=401, raw=json.dumps({"error": {"message": f"invalid key {KEY}"}}).encode()))
    with pytest.raises(RouteError) as error:
        complete(gateway_client, routed_for(router, {"text": "x"}))
    assert error.value.reason == "rejected" and KEY not in str(error.value) and "HTTP 401" in str(error.value)


def test_gateway_retries_429_and_5xx_with_backoff(router, fake, gateway_client):
    fake.script(Reply(status=500), Reply(status=429))
    completion = complete(gateway_client, routed_for(router, {"text": "x"}))
    assert completion.attempts == 3 and len(fake.requests) == 3
    fake.reset()
    fake.script(Reply(status=503), Reply(status=503), Reply(status=503))
    with pytest.raises(RouteError, match=r"HTTP 503.*after 3 attempts") as error:
        complete(gateway_client, routed_for(router, {"text": "x"}))
    assert error.value.reason == "upstream_status" and len(fake.requests) == 3


def test_gateway_timeout_garbage_and_missing_usage(router, fake, gateway_client):
    fake.script(*[Reply(delay_s=1.0)] * 3)
    started = time.monotonic()
    with pytest.raises(RouteError, match="did not answer within 0.5 s") as error:
        complete(gateway_client, routed_for(router, {"text": "x"}))
    assert error.value.reason == "timeout" and time.monotonic() - started < 3.0
    fake.script(Reply(raw=b"this is not json"))
    with pytest.raises(RouteError) as error:
        complete(gateway_client, routed_for(router, {"text": "x"}))
    assert error.value.reason == "bad_response"
    fake.script(Reply(prompt_tokens=None))
    with pytest.raises(RouteError, match="no usable token usage") as error:
        complete(gateway_client, routed_for(router, {"text": "x"}))


def test_one_deadline_bounds_every_attempt_and_backoff(router, fake):
    """A hung gateway: 3 attempts of up to 0.5 s each would take 1.5 s; the request's own deadline
    of 0.8 s ends it, the last attempt cut to what was left."""
    fake.reset()
    client = GatewayClient(FAST, {BASE_URL_ENV: fake.base_url, API_KEY_ENV: KEY})
    fake.default = Reply(delay_s=30)
    started = time.monotonic()
    with pytest.raises(RouteError) as error:
        complete(client, routed_for(router, {"text": "x"}), deadline_s=0.8)
    elapsed = time.monotonic() - started
    fake.reset()
    assert error.value.reason == "timeout" and 0.75 < elapsed < 1.2, (elapsed, str(error.value))


def test_retry_after_is_honoured_when_it_fits_and_refused_when_it_does_not(router, fake):
    fake.reset()
    client = GatewayClient(FAST, {BASE_URL_ENV: fake.base_url, API_KEY_ENV: KEY})
    fake.script(Reply(status=429, headers={"Retry-After": "0.4"}))
    started = time.monotonic()
    assert complete(client, routed_for(router, {"text": "x"})).attempts == 2
    assert time.monotonic() - started >= 0.4  # it waited as asked, not its own 10 ms backoff
    fake.reset()
    fake.script(Reply(status=503, headers={"Retry-After": "30"}))
    started = time.monotonic()
    with pytest.raises(RouteError, match="retry after 30.0 s would pass the request's deadline of 2 s"):
        complete(client, routed_for(router, {"text": "x"}), deadline_s=2.0)
    assert time.monotonic() - started < 0.5 and len(fake.requests) == 1  # failed at once, no wait


def test_retry_after_header_forms():
    assert retry_after_s({"retry-after": "2"}) == 2.0
    assert retry_after_s({"retry-after-ms": "250"}) == 0.25
    assert 9 < retry_after_s({"retry-after": email.utils.formatdate(time.time() + 10, usegmt=True)}) <= 10
    assert retry_after_s({"retry-after": "soon"}) is None and retry_after_s({}) is None


def test_gateway_unreachable_opens_that_models_circuit_then_recovers(router, fake):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    client = GatewayClient(FAST, {BASE_URL_ENV: dead_url, API_KEY_ENV: KEY})
    for _ in range(3):
        with pytest.raises(RouteError, match="unreachable") as error:
            complete(client, routed_for(router, {"text": "x"}))
    started = time.monotonic()
    with pytest.raises(RouteError, match="circuit open") as error:
        complete(client, routed_for(router, {"text": "x"}))
    assert error.value.reason == "circuit_open" and time.monotonic() - started < 0.05
    assert client.breaker("gemini-2.5-flash").state == "open"
    assert client.breaker("deepseek-v3.2").state == "closed"  # one breaker per upstream model
    client.base_url = fake.base_url  # the gateway comes back
    fake.reset()
    assert complete(client, routed_for(router, {"text": "x", "tier": "cheapest"})).text.startswith("echo:deepseek")
    time.sleep(0.35)
    assert complete(client, routed_for(router, {"text": "x"})).text.startswith("echo:")
    assert client.breaker("gemini-2.5-flash").state == "closed"


def test_gateway_not_configured_is_a_clear_error(router):
    client = GatewayClient(FAST, {})
    with pytest.raises(RouteError, match="not configured: set LLM_GATEWAY_BASE_URL and LLM_GATEWAY_API_KEY"):
        complete(client, routed_for(router, {"text": "x"}))


def test_vision_payload_becomes_an_image_message(router):
    image = base64.b64encode(b"fake-png").decode()
    routed = routed_for(router, {"text": "what is this?", "image": image, "tier": "best"}, task="vision_llm")
    assert routed.target == "claude-sonnet-4.5"
    assert routed.messages[0]["content"][1]["image_url"]["url"] == f"data:image/png;base64,{image}"


def test_batch_class_falls_back_to_realtime_only_when_asked_for_batch(router):
    routed = router.prepare(b"speech_recognition", json.dumps({"audio": base64.b64encode(b"RIFF").decode()}), b"batch")
    fallback = Router.fallback(routed)
    assert (routed.target, fallback.target, fallback.latency_class) == (
        "speech_recognition_batch", "speech_recognition", "realtime")
    assert "speech_recognition_batch is not loaded" in fallback.note
    assert Router.fallback(fallback) is None


def canary_request(router, version: int, latency_class: bytes | None = None):
    """A text_embedding request whose key the default split (90/10) sends to ``version``."""
    for i in range(1000):
        routed = router.prepare(b"text_embedding", json.dumps({"text": "x"}).encode(), latency_class, f"user-{i}")
        if routed.model_version == version:
            return routed
    raise AssertionError(f"no key lands on version {version}")


def test_a_canary_version_not_loaded_falls_back_to_the_stable_version(router):
    routed = canary_request(router, 2, b"batch")
    chain = [routed.target]
    while (routed := Router.fallback(routed)) is not None:
        chain.append((routed.target, routed.model_version, routed.latency_class))
        last = routed
    # the canary's realtime model first, then the stable version: the split never costs a request
    assert chain == ["text_embedding_batch_v2", ("text_embedding_v2", 2, "realtime"),
                     ("text_embedding", 1, "realtime")]
    assert "text_embedding_v2 is not loaded: served by the stable version" in last.note
    assert Router.fallback(canary_request(router, 1)) is None  # the stable version has nothing behind it