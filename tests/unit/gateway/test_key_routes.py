"""The pieces that carry a key from the public ports to the router (no server): the screen's key
resolution and its reserved parameter, the refusal marker and its HTTP answer, and the shipped
route file's fallbacks and context windows."""

from __future__ import annotations

import json

import pytest
from tritonclient.grpc import service_pb2

from triton_pipelines.gateway.keys import KEY_ID_PARAMETER, KeyRing, key_id
from triton_pipelines.errors import parse_refusal, refusal_text
from triton_pipelines.repository.routes import RouteTable
from triton_pipelines.front.screen import ScreenError, ScreenPolicy, check_grpc_request, check_http_request
from triton_pipelines.front.screen_server import key_id_for, refused_answer
from tests.support.paths import PROJECT_ROOT

ROUTES = RouteTable.load(PROJECT_ROOT / "data" / "routes.yaml")
SECRET = "sk-team-a-0123456789abcdef"
RING = KeyRing.from_document({"keys": [{"key": SECRET, "name": "team-a"}]})
POLICY = ScreenPolicy(max_body_bytes=1 << 20)


def test_the_screen_forwards_a_known_keys_id_and_refuses_an_unknown_one():
    assert key_id_for(RING, f"Bearer {SECRET}") == key_id(SECRET)
    assert key_id_for(RING, None) is None  # the router decides (gateway tasks need a key)
    with pytest.raises(ScreenError) as refused:
        key_id_for(RING, "Bearer sk-unknown-0123456789abcdef")
    assert (refused.value.status, refused.value.grpc_code) == (401, "UNAUTHENTICATED")
    assert SECRET not in str(refused.value)
    assert key_id_for(None, f"Bearer {SECRET}") is None  # no keys file: open, the bearer ignored


def test_a_request_may_not_carry_the_key_id_parameter_itself():
    body = {"inputs": [{"name": "task", "shape": [1, 1], "datatype": "BYTES", "data": ["general_llm"]}],
            "parameters": {KEY_ID_PARAMETER: "ab" * 32}}
    with pytest.raises(ScreenError, match="reserved"):
        check_http_request(POLICY, "router", "", json.dumps(body).encode(), 0)
    body["parameters"] = {"X-API-Key-Id": "ab" * 32}
    with pytest.raises(ScreenError, match="reserved"):
        check_http_request(POLICY, "router", "", json.dumps(body).encode(), 0)
    request = service_pb2.ModelInferRequest(model_name="router")
    request.inputs.add(name="task", datatype="BYTES", shape=[1, 1])
    request.parameters[KEY_ID_PARAMETER].string_param = "ab" * 32
    with pytest.raises(ScreenError, match="reserved"):
        check_grpc_request(POLICY, request.SerializeToString())
    del request.parameters[KEY_ID_PARAMETER]
    request.parameters["priority"].int64_param = 1
    assert check_grpc_request(POLICY, request.SerializeToString()) == "router"


def test_refusal_marker_round_trip_and_the_screens_answer():
    text = refusal_text(429, "key team-a has reached its budget", 12.2)
    assert text == "[refused 429 retry-after=13] key team-a has reached its budget"
    assert parse_refusal(text) == (429, 13, "key team-a has reached its budget")
    assert parse_refusal("[refused 500] no") is None and parse_refusal("task x: [refused 429] no") is None
    answer = refused_answer(503, json.dumps({"error": text}).encode())
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 429 Too Many Requests") and b"Retry-After: 13" in head
    assert json.loads(body) == {"error": "key team-a has reached its budget"}
    forbidden = refused_answer(400, json.dumps({"error": refusal_text(403, "no")}).encode())
    assert forbidden.startswith(b"HTTP/1.1 403 Forbidden") and b"Retry-After" not in forbidden
    assert refused_answer(503, b'{"error":"the gateway is down"}') is None
    assert refused_answer(200, json.dumps({"error": text}).encode()) is None


def test_every_shipped_gateway_model_has_a_window_and_a_fallback():
    gateway_models = {m for route in ROUTES.tasks.values() if route.route == "gateway" for m in route.models}
    assert gateway_models == set(ROUTES.gateway_models) == set(ROUTES.prices)
    for name, model in ROUTES.gateway_models.items():
        assert model.context_window > 0 and model.fallbacks, name
    for task, route in ROUTES.tasks.items():
        if route.route == "gateway":
            for model in route.models:
                assert len(ROUTES.fallback_chain(task, model)) >= 2, (task, model)


def test_fallback_chains_and_larger_windows():
    assert ROUTES.fallback_chain("code_generation", "claude-sonnet-4.5") == [
        "claude-sonnet-4.5", "gpt-4.1", "deepseek-v3.2"]  # the task's own list
    assert ROUTES.fallback_chain("bulk_llm", "deepseek-v3.2") == ["deepseek-v3.2", "gemini-2.5-flash"]  # its models
    assert ROUTES.fallback_chain(None, "deepseek-v3.2") == ["deepseek-v3.2", "gemini-2.5-flash", "gpt-4.1"]
    assert ROUTES.larger_window(None, "deepseek-v3.2", ["gpt-4.1"]) == "gpt-4.1"
    assert ROUTES.larger_window("code_generation", "deepseek-v3.2", []) == "claude-sonnet-4.5"  # smallest larger
    assert ROUTES.larger_window(None, "gemini-2.5-flash", ["gpt-4.1"]) is None


def test_the_route_file_refuses_bad_fallbacks():
    import yaml

    document = yaml.safe_load((PROJECT_ROOT / "data" / "routes.yaml").read_text())
    document["gateway_models"]["gpt-4.1"]["fallbacks"] = ["no-such-model"]
    with pytest.raises(ValueError, match="must be other priced models"):
        RouteTable.from_document(document)
    document = yaml.safe_load((PROJECT_ROOT / "data" / "routes.yaml").read_text())
    document["tasks"]["bulk_llm"]["fallbacks"] = ["gpt-4.1"]
    with pytest.raises(ValueError, match="not among its models"):
        RouteTable.from_document(document)
