"""The route table without a server: the route file, tiers by price, exact cost, the limits section."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

import pytest

from triton_pipelines.repository.routes import LIMIT_TYPES, RouteTable, choose_model, cost_usd

from tests.support.paths import PROJECT_ROOT

ROUTES = PROJECT_ROOT / "data" / "routes.yaml"


@pytest.fixture(scope="module")
def table() -> RouteTable:
    return RouteTable.load(ROUTES)


def test_route_file_has_every_task_and_the_seed_prices(table):
    assert set(table.tasks) == {"text_embedding", "text_classification", "image_classification",
                                "speech_recognition", "general_llm", "code_generation", "vision_llm", "bulk_llm"}
    assert {t for t, r in table.tasks.items() if r.route == "triton"} == {
        "text_embedding", "text_classification", "image_classification", "speech_recognition"}
    prices = {m: (p.input_per_million, p.output_per_million) for m, p in table.prices.items()}
    assert prices == {"gpt-4.1": (Decimal("8.00"), Decimal("8.00")),
                      "claude-sonnet-4.5": (Decimal("4.50"), Decimal("15.00")),
                      "gemini-2.5-flash": (Decimal("2.50"), Decimal("2.50")),
                      "deepseek-v3.2": (Decimal("0.42"), Decimal("1.68"))}


@pytest.mark.parametrize("tier, expected", [(None, "gemini-2.5-flash"), ("cheapest", "deepseek-v3.2"),
                                            ("balanced", "gemini-2.5-flash"), ("best", "claude-sonnet-4.5")])
def test_tier_picks_by_price_within_the_task(table, tier, expected):
    # general_llm ranks by input+output $/M: deepseek 2.10 < gemini 5.00 < gpt-4.1 16.00 < claude 19.50
    assert choose_model(table.tasks["general_llm"], table.prices, tier) == expected


def test_tier_stays_within_the_allowed_list(table):
    assert choose_model(table.tasks["bulk_llm"], table.prices, "best") == "gemini-2.5-flash"
    assert choose_model(table.tasks["code_generation"], table.prices, "cheapest") == "deepseek-v3.2"


def test_cost_prices_input_and_output_separately_and_exactly(table):
    assert cost_usd(table.prices["claude-sonnet-4.5"], 1234, 567) == 0.014058  # 1234*4.50 + 567*15.00
    assert cost_usd(table.prices["deepseek-v3.2"], 1_000_000, 1_000_000) == 2.10
    assert cost_usd(table.prices["gpt-4.1"], 0, 0) == 0.0


def test_route_file_limits_override_the_table_defaults_and_only_those():
    defaults = RouteTable.from_document({})
    assert {name: getattr(defaults, name) for name in LIMIT_TYPES} == {
        f.name: f.default for f in dataclasses.fields(RouteTable) if f.name in LIMIT_TYPES}
    table = RouteTable.from_document({"limits": {"max_rows_per_request": "8", "triton_deadline_s": 5}})
    assert (table.max_rows_per_request, table.triton_deadline_s, table.max_payload_bytes) == (8, 5.0, 8 << 20)
    assert isinstance(table.triton_deadline_s, float)
