"""The spend ledger on a real PostgreSQL server (tests/support/postgres_server.py) shared by two launchers:
16 concurrent clients cannot jointly overspend a key's budget, and the spend survives a restart."""

from __future__ import annotations

import os
import threading
from decimal import Decimal

import pytest
import yaml

from triton_pipelines.gateway.keys import KeyRing
from triton_pipelines.server.launcher import start_on_free_ports
from triton_pipelines.gateway.ledger import KeyLimits, SpendLedger, nano_usd

from tests.conftest import LOG_DIR, ensure_repository
from tests.support.gateway_helpers import environment, http_route, router_repository

SECRET = f"sk-shared-{os.urandom(12).hex()}"
KEYS = {"keys": [{"key": SECRET, "name": "team-shared", "max_budget_usd": 0.005, "budget_period": "30d"}]}
CALL = {"text": "hi", "tier": "best", "max_tokens": 20}  # claude-sonnet-4.5: 154.5 µ$ at the fake's usage


@pytest.fixture(scope="module")
def setup(fake, postgres_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gateway-postgres")
    repository = router_repository(ensure_repository(), folder / "repository", {"max_retries": 0})
    keys = folder / "keys.yaml"
    keys.write_text(yaml.safe_dump(KEYS))
    return repository, keys, postgres_server.database("gateway_two_launchers")


def start(setup, fake, name: str):
    repository, keys, database = setup
    with environment(LLM_GATEWAY_BASE_URL=fake.base_url, LLM_GATEWAY_API_KEY="gw-" + os.urandom(8).hex(),
                     TRITON_API_KEYS_FILE=str(keys), SPEND_DATABASE_URL=database):
        return start_on_free_ports(repository, LOG_DIR / f"test-gateway-postgres-{name}.log", timeout_s=180)


def test_two_launchers_on_one_database_cannot_jointly_overspend_and_restart_keeps_spend(setup, fake):
    fake.reset()
    servers = [start(setup, fake, "a"), start(setup, fake, "b")]
    statuses: list[int] = []
    costs: list[Decimal] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        address = servers[index % 2].http_url
        while True:
            status, _, body = http_route(address, "general_llm", CALL, secret=SECRET)
            with lock:
                statuses.append(status)
                if status == 200:
                    costs.append(Decimal(str(body["result"]["usage"]["cost_usd"])))
            if status != 200:
                return

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert set(statuses) == {200, 429}, statuses
        one_call = nano_usd(costs[0])
        ledger = SpendLedger(setup[2])
        limits = KeyLimits.of(next(iter(KeyRing.from_document(KEYS))))
        spend = ledger.key_spend(limits)
        assert spend.reserved_nusd == 0 and spend.spent_nusd == nano_usd(sum(costs))
        # one in-flight call per replica at most past the budget (the lock makes it one in all)
        assert nano_usd("0.005") <= spend.spent_nusd <= nano_usd("0.005") + 2 * one_call
        assert {row["replica"] for row in ledger.rows()} and len(ledger.rows()) == len(costs)
    finally:
        for server in servers:
            server.stop()
    again = start(setup, fake, "restart")
    try:
        status, headers, body = http_route(again.http_url, "general_llm", CALL, secret=SECRET)
        assert status == 429 and "team-shared" in body["error"] and int(headers["retry-after"]) >= 1
    finally:
        again.stop()
