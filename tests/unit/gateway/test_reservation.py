"""A call's reservation is an upper bound of what it may cost (issue 33 §1), with GatewayService
against the loopback fake gateway and a real SQLite ledger: without ``max_tokens`` a call is sent
and reserved the model's output limit; parts whose cost cannot be bounded (audio, files) are
refused before any call; a call billed above its reservation is charged in full, flagged (log,
metric, the row's outcome) and counts against its key at once; concurrent calls near a budget
exceed it by at most one call."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tests.support.fake_gateway import Reply
from tests.unit.gateway.test_service import MESSAGES, ROUTES, SECRET_A, service
from triton_pipelines.errors import InputError
from triton_pipelines.gateway.ledger import call_cost_nusd, nano_usd
from triton_pipelines.gateway.refusal import GatewayRefusal
from triton_pipelines.repository.routes import (
    RoutesFileError,
    RouteTable,
    estimate_prompt_tokens,
)


@pytest.fixture(autouse=True)
def clean(fake):
    fake.reset()
    yield
    fake.reset()


def with_output_limit(gateway, model: str, limit: int) -> None:
    table = gateway.table
    models = dict(table.gateway_models, **{model: dataclasses.replace(table.gateway_models[model],
                                                                      max_output_tokens=limit)})
    gateway.table = dataclasses.replace(table, gateway_models=models)
    gateway.admission.output_limit = gateway.table.output_limit


def test_without_max_tokens_a_call_is_sent_and_reserved_the_models_output_limit(fake, tmp_path):
    gateway, _ = service(fake, tmp_path)
    with_output_limit(gateway, "gpt-4.1", 3000)
    gateway.complete(None, model="gpt-4.1", messages=MESSAGES)
    gateway.complete(None, model="gpt-4.1", messages=MESSAGES, max_tokens=20)
    gateway.complete(None, model="deepseek-v3.2", messages=MESSAGES)  # no limit stated: the default
    sent = [request.body["max_tokens"] for request in fake.requests]
    assert sent == [3000, 20, gateway.table.gateway.default_max_tokens]
    prompt = estimate_prompt_tokens(MESSAGES)
    assert [row["reserved_tokens"] for row in gateway.ledger.rows()] == [prompt + tokens for tokens in sent]
    gateway.close()


def test_the_output_limit_is_read_from_the_route_file_and_capped(tmp_path):
    text = ROUTES.read_text().replace("gpt-4.1: {context_window: 1047576,",
                                      "gpt-4.1: {context_window: 1047576, max_output_tokens: 32768,")
    (tmp_path / "routes.yaml").write_text(text)
    table = RouteTable.load(tmp_path / "routes.yaml")
    assert table.output_limit("gpt-4.1") == table.gateway.max_tokens_limit  # 32768 capped at the limit
    assert table.output_limit("deepseek-v3.2") == table.gateway.default_max_tokens
    (tmp_path / "bad.yaml").write_text(text.replace("max_output_tokens: 32768", "max_output_tokens: 0"))
    with pytest.raises(RoutesFileError, match="gateway_models.gpt-4.1.max_output_tokens must be a whole number"):
        RouteTable.load(tmp_path / "bad.yaml")


@pytest.mark.parametrize("part", [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_data": "data:application/pdf;base64,AAAA"}},
                                  "a bare string"])
def test_parts_whose_cost_cannot_be_bounded_are_refused_before_any_call(fake, tmp_path, part):
    gateway, _ = service(fake, tmp_path)
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    with pytest.raises(InputError, match=r"messages\[0\]\.content\[1\] is a .*: a gateway prompt takes only "
                                         r"'text' and 'image_url' parts"):
        gateway.complete(None, model="gpt-4.1", messages=messages)
    assert fake.requests == [] and gateway.ledger.rows() == []
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}]
    gateway.complete(None, model="gpt-4.1", messages=image, max_tokens=5)  # images: at the stated bound
    (row,) = gateway.ledger.rows()
    assert row["reserved_tokens"] == 16 + 8 + gateway.table.gateway.image_tokens_estimate + 5
    gateway.close()


def test_a_call_billed_above_its_reservation_is_charged_in_full_flagged_and_counted_at_once(fake, tmp_path):
    keys = [{"key": SECRET_A, "name": "team-a", "max_budget_usd": 0.01, "budget_period": "1h"}]
    gateway, recorder = service(fake, tmp_path, keys)
    logged = []
    gateway.admission.log = logged.append
    team_a = gateway.authenticate(f"Bearer {SECRET_A}")
    fake.default = Reply(prompt_tokens=10_000, completion_tokens=5)  # the provider counted a far larger prompt
    gateway.complete(team_a, model="gpt-4.1", messages=MESSAGES, max_tokens=5)
    (row,) = gateway.ledger.rows()
    price = gateway.table.prices["gpt-4.1"]
    billed = call_cost_nusd(price.input_per_million, price.output_per_million, 10_000, 5)
    assert (row["status"], row["cost_nusd"], row["outcome"]) == ("success", billed, "success_over_reservation")
    assert row["reserved_nusd"] < billed
    ((_, key_name, model, over),) = [e for e in recorder.events if e[0] == "overspend"]
    assert (key_name, model) == ("team-a", "gpt-4.1") and over == pytest.approx((billed - row["reserved_nusd"]) / 1e9)
    assert any("above its reservation" in line and "team-a" in line for line in logged)
    with pytest.raises(GatewayRefusal) as refused:  # $0.02 spent of $0.01: the next call is refused at once
        gateway.complete(team_a, model="gpt-4.1", messages=MESSAGES, max_tokens=5)
    assert refused.value.reason == "over_budget"
    gateway.close()


def test_concurrent_calls_near_a_budget_exceed_it_by_at_most_one_call(fake, tmp_path):
    budget = 0.002
    keys = [{"key": SECRET_A, "name": "team-a", "max_budget_usd": budget, "budget_period": "1h"}]
    gateway, _ = service(fake, tmp_path, keys)
    team_a = gateway.authenticate(f"Bearer {SECRET_A}")
    fake.default = Reply(delay_s=0.05, prompt_tokens=26, completion_tokens=100)  # within the reservation

    async def call():
        try:
            await gateway.acomplete(team_a, model="gpt-4.1", messages=MESSAGES, max_tokens=100)
        except GatewayRefusal:
            pass

    async def fifty():
        await asyncio.gather(*(call() for _ in range(50)))

    asyncio.run(fifty())
    rows = gateway.ledger.rows()
    assert all(row["status"] == "success" and row["outcome"] == "success" for row in rows)
    spent = sum(row["cost_nusd"] for row in rows)
    assert nano_usd(budget) <= spent <= nano_usd(budget) + max(row["reserved_nusd"] for row in rows), (len(rows), spent)
    gateway.close()
