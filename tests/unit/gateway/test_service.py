"""GatewayService (gateway_service.py) against the loopback fake gateway over real HTTP and a real
SQLite ledger: keys, budgets, rpm, fallbacks on 429/5xx, context-window fallback, cooldowns, and
the ledger's rows (one charge per answered call, failed attempts charged zero)."""

from __future__ import annotations

import asyncio
import dataclasses
from decimal import Decimal

import pytest

from triton_pipelines.gateway.keys import KeyRing
from triton_pipelines.errors import RouteError, parse_refusal
from triton_pipelines.gateway.upstream import GatewayClient
from triton_pipelines.gateway.refusal import GatewayRefusal
from triton_pipelines.gateway.service import GatewayService
from triton_pipelines.repository.routes import RouteTable
from triton_pipelines.gateway.ledger import SpendLedger

from tests.support.fake_gateway import Reply, context_length_error
from tests.support.paths import PROJECT_ROOT

ROUTES = PROJECT_ROOT / "data" / "routes.yaml"
SECRET_A, SECRET_B = "sk-team-a-0123456789abcdef", "sk-team-b-0123456789abcdef"


class Recorder:
    def __init__(self):
        self.events = []

    def __getattr__(self, name):
        return lambda *args: self.events.append((name,) + args)


def table(**gateway) -> RouteTable:
    base = RouteTable.load(ROUTES)
    settings = dataclasses.replace(base.gateway, max_retries=0, backoff_s=0.01, circuit_failure_threshold=2,
                                   circuit_reset_s=60.0, **gateway)
    return dataclasses.replace(base, gateway=settings)


def service(fake, tmp_path, keys=None, **gateway) -> tuple[GatewayService, Recorder]:
    routes = table(**gateway)
    recorder = Recorder()
    ring = KeyRing.from_document({"keys": keys}) if keys else None
    client = GatewayClient(routes.gateway, {"LLM_GATEWAY_BASE_URL": fake.base_url, "LLM_GATEWAY_API_KEY": "gw-key"})
    ledger = SpendLedger(f"sqlite:///{tmp_path / 'spend.db'}")
    return GatewayService(routes, client, ledger, ring, recorder), recorder


MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(autouse=True)
def clean(fake):
    fake.reset()
    yield
    fake.reset()


def test_an_answer_is_charged_once_at_the_reported_usage(fake, tmp_path):
    gateway, recorder = service(fake, tmp_path)
    answer = gateway.complete(None, model="gpt-4.1", messages=MESSAGES, max_tokens=100)
    assert (answer.model, answer.input_tokens, answer.output_tokens) == ("gpt-4.1", 11, 7)
    assert answer.cost_usd == Decimal("0.000144") and answer.fallback_from is None
    (row,) = gateway.ledger.rows()
    assert (row["status"], row["cost_nusd"], row["key_name"], row["key_id"]) == ("success", 144_000, "anonymous", "")
    assert row["reserved_nusd"] >= row["cost_nusd"]
    assert ("spend", "anonymous", "gpt-4.1", 0.000144) in recorder.events
    gateway.close()


def test_429_falls_back_to_the_next_model_with_the_reason(fake, tmp_path):
    gateway, recorder = service(fake, tmp_path)
    fake.for_model("gpt-4.1", Reply(status=429))
    answer = gateway.complete(None, model="gpt-4.1", messages=MESSAGES)
    assert (answer.model, answer.fallback_from, answer.fallback_reason) == ("claude-sonnet-4.5", "gpt-4.1",
                                                                             "rate_limited")
    rows = gateway.ledger.rows()
    assert [(r["model"], r["status"], r["cost_nusd"]) for r in rows] == [
        ("gpt-4.1", "failed", 0), ("claude-sonnet-4.5", "success", 154_500)]
    assert rows[1]["fallback_from"] == "gpt-4.1" and rows[1]["fallback_reason"] == "rate_limited"
    assert ("fallback", "gpt-4.1", "claude-sonnet-4.5", "rate_limited") in recorder.events
    gateway.close()


def test_a_task_falls_back_in_its_own_order_and_5xx_is_upstream_error(fake, tmp_path):
    gateway, _ = service(fake, tmp_path)
    fake.for_model("claude-sonnet-4.5", Reply(status=500))
    answer = gateway.complete(None, task="code_generation", messages=MESSAGES)
    assert (answer.model, answer.fallback_reason) == ("gpt-4.1", "upstream_error")  # code_generation's fallbacks
    gateway.close()


def test_context_window_error_goes_to_a_larger_window(fake, tmp_path):
    gateway, _ = service(fake, tmp_path)
    fake.for_model("deepseek-v3.2", context_length_error())
    answer = gateway.complete(None, model="deepseek-v3.2", messages=MESSAGES)
    # deepseek's chain is gemini, gpt-4.1: gemini-2.5-flash (1M) is the first with a larger window
    assert (answer.model, answer.fallback_reason) == ("gemini-2.5-flash", "context_window")
    fake.for_model("gemini-2.5-flash", context_length_error())
    fake.for_model("gpt-4.1", context_length_error())
    with pytest.raises(RouteError) as failed:
        gateway.complete(None, model="gemini-2.5-flash", messages=MESSAGES)
    assert failed.value.reason == "context_window"
    gateway.close()


def test_a_failing_model_cools_down_and_is_skipped(fake, tmp_path):
    gateway, recorder = service(fake, tmp_path)
    fake.for_model("gpt-4.1", Reply(status=503))
    for _ in range(2):  # circuit_failure_threshold 2
        gateway.complete(None, model="gpt-4.1", messages=MESSAGES)
    assert ("cooldown", "gpt-4.1") in recorder.events
    calls = len([r for r in fake.requests if r.body.get("model") == "gpt-4.1"])
    answer = gateway.complete(None, model="gpt-4.1", messages=MESSAGES)
    assert (answer.model, answer.fallback_reason) == ("claude-sonnet-4.5", "cooldown")
    assert len([r for r in fake.requests if r.body.get("model") == "gpt-4.1"]) == calls  # not called
    gateway.close()


def test_other_4xx_do_not_fall_back(fake, tmp_path):
    gateway, _ = service(fake, tmp_path)
    fake.for_model("gpt-4.1", Reply(status=400))
    with pytest.raises(RouteError) as failed:
        gateway.complete(None, model="gpt-4.1", messages=MESSAGES)
    assert failed.value.reason == "rejected"
    assert [r["model"] for r in gateway.ledger.rows()] == ["gpt-4.1"]
    gateway.close()


def test_keys_budget_and_allow_list(fake, tmp_path):
    keys = [{"key": SECRET_A, "name": "team-a", "max_budget_usd": 0.0003, "budget_period": "1h"},
            {"key": SECRET_B, "name": "team-b", "models": ["deepseek-v3.2"]}]
    gateway, recorder = service(fake, tmp_path, keys)
    with pytest.raises(GatewayRefusal) as refused:
        gateway.complete(None, model="gpt-4.1", messages=MESSAGES)
    assert (refused.value.status, refused.value.grpc_code) == (401, "UNAUTHENTICATED")
    with pytest.raises(GatewayRefusal):
        gateway.authenticate("Bearer sk-not-a-known-key-000000")
    team_a = gateway.authenticate(f"Bearer {SECRET_A}")
    served = 0
    with pytest.raises(GatewayRefusal) as refused:
        for _ in range(10):
            gateway.complete(team_a, model="gpt-4.1", messages=MESSAGES, max_tokens=10)
            served += 1
    assert served == 3  # 0, 144, 288 µ$ < 300 µ$ when admitted; 432 µ$ spent ≤ budget + one call
    error = refused.value
    assert (error.status, error.grpc_code, error.reason, error.limit) == (429, "RESOURCE_EXHAUSTED", "over_budget",
                                                                          "budget")
    assert "team-a" in error.message and "$0.0003" in error.message and 1 <= error.retry_after_s <= 3600
    status, retry_after, text = parse_refusal(error.marked())
    assert (status, retry_after, text) == (429, error.retry_after_s, error.message)
    team_b = gateway.authenticate(f"Bearer {SECRET_B}")
    with pytest.raises(GatewayRefusal) as refused:
        gateway.complete(team_b, model="gpt-4.1", messages=MESSAGES)
    assert refused.value.status == 403 and "team-b may not use model gpt-4.1" in refused.value.message
    fake.for_model("deepseek-v3.2", Reply(status=429))  # its fallbacks are not in team-b's models
    with pytest.raises(RouteError):
        gateway.complete(team_b, model="deepseek-v3.2", messages=MESSAGES)
    rows = gateway.ledger.rows()
    assert all(SECRET_A not in str(r) and SECRET_B not in str(r) for r in rows)
    assert {r["key_name"] for r in rows} == {"team-a", "team-b"}
    assert ("refusal", "team-a", "over_budget") in recorder.events
    gateway.close()


def test_rpm_refusal_says_when_to_retry(fake, tmp_path):
    gateway, _ = service(fake, tmp_path, [{"key": SECRET_A, "name": "team-a", "rpm": 2}])
    team_a = gateway.keys.by_id(next(iter(gateway.keys)).key_id)
    gateway.complete(team_a, model="gpt-4.1", messages=MESSAGES)
    fake.for_model("gpt-4.1", Reply(status=429))
    gateway.complete(team_a, model="gpt-4.1", messages=MESSAGES)  # a fallback is the same request
    with pytest.raises(GatewayRefusal) as refused:
        gateway.complete(team_a, model="gpt-4.1", messages=MESSAGES)
    assert refused.value.limit == "rpm" and 55 <= refused.value.retry_after_s <= 60
    gateway.close()


def test_acomplete_on_the_callers_loop(fake, tmp_path):
    gateway, _ = service(fake, tmp_path)

    async def two():
        return await asyncio.gather(*(gateway.acomplete(None, model="deepseek-v3.2", messages=MESSAGES)
                                      for _ in range(2)))

    assert [a.model for a in asyncio.run(two())] == ["deepseek-v3.2"] * 2
    assert len(gateway.ledger.rows()) == 2


def test_stream_yields_chunks_then_usage_with_cost_and_falls_back_before_the_first(fake, tmp_path):
    gateway, _ = service(fake, tmp_path)
    fake.for_model("gpt-4.1", Reply(status=429))
    chunks = list(gateway.stream(None, model="gpt-4.1", messages=MESSAGES, max_tokens=50))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "echo:claude-sonnet-4.5:hello"
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"] == {"prompt_tokens": 11, "completion_tokens": 7,
                                                          "total_tokens": 18, "cost_usd": 0.0001545}
    assert final["x_gateway"]["fallback_from"] == "gpt-4.1" and final["x_gateway"]["fallback_reason"] == "rate_limited"
    # the first chunk already says which model answers and why (the frontend's response headers)
    assert chunks[0]["x_gateway"] == final["x_gateway"] and final["x_gateway"]["model"] == "claude-sonnet-4.5"
    assert all("x_gateway" not in c for c in chunks[1:-1])
    assert [(r["model"], r["status"], r["cost_nusd"]) for r in gateway.ledger.rows()] == [
        ("gpt-4.1", "failed", 0), ("claude-sonnet-4.5", "success", 154_500)]
    assert fake.requests[-1].body["stream"] is True
    gateway.close()


def test_a_stream_its_client_leaves_is_charged_its_reservation(fake, tmp_path):
    gateway, _ = service(fake, tmp_path)
    chunks = gateway.stream(None, model="deepseek-v3.2", messages=MESSAGES, max_tokens=50)
    first = next(c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))
    assert first["choices"][0]["delta"]["content"]
    chunks.close()  # the client went away mid-stream
    (row,) = gateway.ledger.rows()
    assert row["status"] == "failed" and row["outcome"] == "stream_interrupted"
    assert row["cost_nusd"] == row["reserved_nusd"] > 0
    gateway.close()


def test_stream_refusals_raise_before_any_chunk(fake, tmp_path):
    gateway, _ = service(fake, tmp_path, [{"key": SECRET_A, "name": "team-a", "models": ["deepseek-v3.2"]}])
    with pytest.raises(GatewayRefusal) as refused:
        next(gateway.stream(gateway.authenticate(f"Bearer {SECRET_A}"), model="gpt-4.1", messages=MESSAGES))
    assert refused.value.status == 403
    gateway.close()


def test_a_message_that_cannot_be_encoded_is_the_clients_error_not_the_models(fake, tmp_path):
    """A lone surrogate in a message (valid JSON, not encodable as UTF-8) is a 400 before any model
    is tried: no upstream call, no failure counted against the models, so a few such requests from
    one client cannot open the circuits for everyone (issue 33 §3)."""
    from triton_pipelines.errors import InputError

    gateway, recorder = service(fake, tmp_path)
    bad = [{"role": "user", "content": [{"type": "text", "text": "hi \ud800 there"}]}]
    for _ in range(5):  # circuit_failure_threshold is 2
        with pytest.raises(InputError, match=r"messages\[0\]\.content\[0\]\.text holds a lone UTF-16 surrogate"):
            gateway.complete(None, model="gpt-4.1", messages=bad)
    assert fake.requests == [] and not [e for e in recorder.events if e[0] in ("failure", "cooldown")]
    assert gateway.ledger.rows() == []
    answer = gateway.complete(None, model="gpt-4.1", messages=MESSAGES)
    assert (answer.model, answer.fallback_reason) == ("gpt-4.1", None)
    gateway.close()


def test_a_recorder_set_after_the_service_records_every_part(fake, tmp_path):
    """The /v1 frontend sets its metrics as the recorder after building the service: budgets,
    refusals and spend all reach it (the collaborators included)."""
    keys = [{"key": SECRET_A, "name": "team-a", "max_budget_usd": 0.001, "budget_period": "1d"}]
    gateway, _ = service(fake, tmp_path, keys=keys)
    later = Recorder()
    gateway.recorder = later
    gateway.complete(gateway.authenticate(f"Bearer {SECRET_A}"), model="gpt-4.1", messages=MESSAGES, max_tokens=10)
    with pytest.raises(GatewayRefusal):
        gateway.authenticate("Bearer sk-not-a-known-key-000000")
    kinds = {event[0] for event in later.events}
    assert {"spend", "budget", "refusal"} <= kinds, kinds
    gateway.close()
