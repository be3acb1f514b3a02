"""Keys, budgets, rate limits, fallbacks and the spend ledger through the public ports of a real
server (nginx → request screen → tritonserver → router), HTTP and gRPC, against the loopback fake
gateway (tests/support/fake_gateway.py); the ledger is a real SQLite file here and a real PostgreSQL
server in test_gateway_postgres.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from decimal import Decimal

import pytest
import yaml

from triton_pipelines import prometheus_text
from triton_pipelines.server.launcher import start_on_free_ports
from triton_pipelines.server.processes import find_stubs
from triton_pipelines.gateway.ledger import SpendLedger, nano_usd

from tests.conftest import LOG_DIR, ensure_repository
from tests.support.fake_gateway import Reply, context_length_error
from tests.support.gateway_helpers import environment, grpc_route, http_route, router_repository

SECRETS = {name: f"sk-{name}-{os.urandom(12).hex()}" for name in ("budget", "rpm", "tpm", "narrow", "open", "replicas",
                                                                   "concurrent", "overbill")}
GATEWAY_KEY = "gw-" + os.urandom(12).hex()
GATEWAY = {"timeout_s": 3.0, "max_retries": 0, "backoff_s": 0.05, "circuit_failure_threshold": 50,
           "deadline_s": 8.0, "reservation_margin_s": 2.0}
HELLO = {"text": "hello", "max_tokens": 20}


def keys_document() -> dict:
    return {"keys": [
        {"key": SECRETS["budget"], "name": "team-budget", "max_budget_usd": 0.005, "budget_period": "1d",
         "soft_budget_usd": 0.004},
        {"key": SECRETS["rpm"], "name": "team-rpm", "rpm": 2},
        {"key": SECRETS["tpm"], "name": "team-tpm", "tpm": 30},
        {"key": SECRETS["narrow"], "name": "team-narrow", "models": ["deepseek-v3.2", "gemini-2.5-flash"]},
        {"key": SECRETS["open"], "name": "team-open"},
        {"key": SECRETS["replicas"], "name": "team-replicas", "max_budget_usd": 0.003},
        {"key": SECRETS["concurrent"], "name": "team-concurrent", "max_budget_usd": 0.003},
        {"key": SECRETS["overbill"], "name": "team-overbill", "max_budget_usd": 0.01},
    ]}


@pytest.fixture(scope="module")
def setup(fake, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gateway-server")
    repository = router_repository(ensure_repository(), folder / "repository", GATEWAY)
    keys = folder / "keys.yaml"
    keys.write_text(yaml.safe_dump(keys_document()))
    database = f"sqlite:///{folder / 'spend.db'}"
    return repository, keys, database, LOG_DIR / "test-gateway-server.log"


def start(setup, fake, **options):
    repository, keys, database, log = setup
    with environment(LLM_GATEWAY_BASE_URL=fake.base_url, LLM_GATEWAY_API_KEY=GATEWAY_KEY,
                     TRITON_API_KEYS_FILE=str(keys), SPEND_DATABASE_URL=database):
        return start_on_free_ports(repository, log, timeout_s=180, **options)


@pytest.fixture(scope="module")
def server(setup, fake):
    server = start(setup, fake)
    yield server
    server.stop()


@pytest.fixture
def gateway(fake, server):
    fake.reset()
    yield fake
    fake.reset()


def ledger(setup) -> SpendLedger:
    return SpendLedger(setup[2])


def test_a_gateway_task_needs_a_known_key(server, gateway):
    status, _, body = http_route(server.http_url, "general_llm", HELLO)
    assert status == 401 and "gateway requests need an API key" in body["error"]
    status, _, body = http_route(server.http_url, "general_llm", HELLO, secret="sk-nobody-0123456789abcdef")
    assert status == 401 and body["error"] == "the API key is not known to this server"
    _, error = grpc_route(server.grpc_url, "general_llm", HELLO, secret="sk-nobody-0123456789abcdef")
    assert error.status() == "StatusCode.UNAUTHENTICATED"
    _, error = grpc_route(server.grpc_url, "general_llm", HELLO)
    assert error.status() == "StatusCode.UNAUTHENTICATED" and "need an API key" in error.message()
    result, error = grpc_route(server.grpc_url, "general_llm", HELLO, secret=SECRETS["open"])
    assert error is None and result["model"] == "gemini-2.5-flash"
    assert not gateway.requests[0].headers.get("authorization", "").endswith(SECRETS["open"])


def test_a_client_cannot_name_a_key_id_itself(server, gateway):
    status, _, body = http_route(server.http_url, "general_llm", HELLO,
                                 parameters={"x-api-key-id": "ab" * 32})
    assert status == 400 and "reserved" in body["error"]


def test_a_model_outside_the_keys_list_is_forbidden(server, gateway):
    status, _, body = http_route(server.http_url, "general_llm", {"text": "hi", "tier": "best"},
                                 secret=SECRETS["narrow"])
    assert status == 403 and "team-narrow may not use model claude-sonnet-4.5" in body["error"]
    status, _, body = http_route(server.http_url, "general_llm", HELLO, secret=SECRETS["narrow"])
    assert status == 200 and body["result"]["model"] == "gemini-2.5-flash"


def test_429_falls_back_and_a_context_window_error_goes_larger(server, gateway, setup):
    gateway.for_model("gemini-2.5-flash", Reply(status=429))
    status, _, body = http_route(server.http_url, "general_llm", HELLO, secret=SECRETS["open"])
    assert status == 200, body
    result = body["result"]
    assert result["model"] == "gpt-4.1" and result["fallback"] == {"from": "gemini-2.5-flash",
                                                                    "reason": "rate_limited"}
    assert result["usage"]["cost_usd"] == pytest.approx((11 * 8.0 + 7 * 8.0) / 1e6)
    gateway.for_model("gemini-2.5-flash", None)
    gateway.for_model("deepseek-v3.2", context_length_error())
    result, error = grpc_route(server.grpc_url, "bulk_llm", HELLO, secret=SECRETS["open"])
    assert error is None and result["model"] == "gemini-2.5-flash"
    assert result["fallback"] == {"from": "deepseek-v3.2", "reason": "context_window"}
    rows = ledger(setup).rows("WHERE key_name = ?", ("team-open",))
    assert [(r["model"], r["status"], r["cost_nusd"]) for r in rows[-4:]] == [
        ("gemini-2.5-flash", "failed", 0), ("gpt-4.1", "success", 144_000),
        ("deepseek-v3.2", "failed", 0), ("gemini-2.5-flash", "success", 45_000)]


def test_the_budget_is_refused_within_one_call_and_never_overspent(server, gateway, setup):
    """$0.005 at claude-sonnet-4.5's price (154.5 µ$ a call at the fake's usage): the calls stop
    at the budget, the first refusal is a 429 naming the key and the limit, with Retry-After."""
    costs = []
    for _ in range(60):
        status, headers, body = http_route(server.http_url, "general_llm", {"text": "hi", "tier": "best"},
                                           secret=SECRETS["budget"])
        if status != 200:
            break
        costs.append(Decimal(str(body["result"]["usage"]["cost_usd"])))
    assert status == 429, body
    assert "team-budget" in body["error"] and "budget of $0.005" in body["error"]
    assert 1 <= int(headers["retry-after"]) <= 86400
    total = ledger(setup).key_spend(next_key("team-budget")).committed_nusd
    assert total == nano_usd(sum(costs))
    assert nano_usd("0.005") <= total <= nano_usd("0.005") + nano_usd(costs[-1])
    _, error = grpc_route(server.grpc_url, "general_llm", HELLO, secret=SECRETS["budget"])
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED" and "team-budget" in error.message()
    text = prometheus_text.scrape(server.metrics_url)
    samples = prometheus_text.parse_samples(text)
    assert prometheus_text.total(samples, "router_budget_remaining_usd", key_name="team-budget") == 0
    assert prometheus_text.total(samples, "router_spend_usd_total", key_name="team-budget") == pytest.approx(
        float(sum(costs)))
    assert prometheus_text.total(samples, "router_refusals_total", key_name="team-budget",
                                 reason="over_budget") >= 2


def test_concurrent_calls_overspend_by_at_most_one_call_and_a_bill_over_the_reservation_is_flagged(
        server, gateway, setup):
    """Issue 33 §1 through the public port: 40 calls at once near a $0.003 budget, each billed its
    whole max_tokens (the most an honest upstream may bill), spend at most the budget plus one
    call; then an upstream that bills 5,000 tokens for a 20-token call is charged in full, flagged
    (the row's outcome, the metric) and the key is refused at once."""
    from concurrent.futures import ThreadPoolExecutor

    gateway.default = Reply(completion_tokens=HELLO["max_tokens"], delay_s=0.3)
    payload = {**HELLO, "tier": "best"}
    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(lambda _: http_route(server.http_url, "general_llm", payload,
                                                     secret=SECRETS["concurrent"]), range(40)))
    costs = [Decimal(str(body["result"]["usage"]["cost_usd"])) for status, _, body in answers if status == 200]
    assert costs and any(status == 429 for status, _, _ in answers), [a[0] for a in answers]
    total = ledger(setup).key_spend(next_key("team-concurrent")).committed_nusd
    assert total == nano_usd(sum(costs)) and total <= nano_usd("0.003") + nano_usd(max(costs)), (total, len(costs))

    gateway.default = Reply(completion_tokens=5000)
    status, _, body = http_route(server.http_url, "general_llm", payload, secret=SECRETS["overbill"])
    assert status == 200, body
    rows = ledger(setup).rows("WHERE key_name = ?", ("team-overbill",))
    assert [(r["output_tokens"], r["outcome"]) for r in rows] == [(5000, "success_over_reservation")]
    assert rows[0]["cost_nusd"] > rows[0]["reserved_nusd"] and rows[0]["cost_nusd"] > nano_usd("0.01")
    samples = prometheus_text.parse_samples(prometheus_text.scrape(server.metrics_url))
    assert prometheus_text.total(samples, "router_over_reservation_total", key_name="team-overbill") == 1
    status, _, body = http_route(server.http_url, "general_llm", payload, secret=SECRETS["overbill"])
    assert status == 429 and "team-overbill" in body["error"], body


def next_key(name: str):
    from triton_pipelines.gateway.keys import KeyRing
    from triton_pipelines.gateway.ledger import KeyLimits

    ring = KeyRing.from_document(keys_document())
    return KeyLimits.of(next(k for k in ring if k.name == name))


def test_rpm_refuses_with_retry_after_and_serves_again_when_the_window_reopens(server, gateway):
    for _ in range(2):
        assert http_route(server.http_url, "general_llm", HELLO, secret=SECRETS["rpm"])[0] == 200
    status, headers, body = http_route(server.http_url, "general_llm", HELLO, secret=SECRETS["rpm"])
    assert status == 429 and "team-rpm has reached its rpm limit of 2" in body["error"]
    wait = int(headers["retry-after"])
    assert 1 <= wait <= 60
    time.sleep(wait + 0.5)
    assert http_route(server.http_url, "general_llm", HELLO, secret=SECRETS["rpm"])[0] == 200


def test_tpm_refuses_with_retry_after_on_both_protocols_and_serves_again(server, gateway):
    """The fake gateway reports 18 tokens a call: two calls reach 36 of the key's 30 a minute."""
    for _ in range(2):
        assert http_route(server.http_url, "general_llm", HELLO, secret=SECRETS["tpm"])[0] == 200
    status, headers, body = http_route(server.http_url, "general_llm", HELLO, secret=SECRETS["tpm"])
    assert status == 429 and "team-tpm" in body["error"] and "tpm" in body["error"]
    wait = int(headers["retry-after"])
    assert 1 <= wait <= 60
    _, error = grpc_route(server.grpc_url, "general_llm", HELLO, secret=SECRETS["tpm"])
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED" and "team-tpm" in error.message()
    calls = len(gateway.requests)
    time.sleep(wait + 0.5)
    assert http_route(server.http_url, "general_llm", HELLO, secret=SECRETS["tpm"])[0] == 200
    assert len(gateway.requests) == calls + 1  # the refusals never reached the gateway


def test_kill_9_of_the_router_during_a_call_loses_no_charge_and_doubles_none(server, gateway, setup):
    """The stub dies while the gateway is answering: the reservation stays (counted against the
    budget), is abandoned at its reserved cost after its deadline, and is one row."""
    gateway.when("slow-call", Reply(delay_s=2.5))  # within the attempt's time-out (3 s)
    failed = []

    def call():
        try:
            failed.append(http_route(server.http_url, "general_llm", {"text": "slow-call", "max_tokens": 20},
                                     secret=SECRETS["open"], timeout_s=15)[0])
        except OSError:  # Triton 2.51 may never answer a request whose stub died mid-way
            failed.append("no answer")

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 10
    while not any("slow-call" in json.dumps(r.body) for r in gateway.requests):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (stub,) = [s for s in find_stubs(server.process.pid) if s.model == "router"]
    os.kill(stub.pid, signal.SIGKILL)
    caller.join(timeout=30)
    assert failed and failed[0] != 200
    rows = [r for r in ledger(setup).rows("WHERE key_name = ?", ("team-open",)) if r["status"] == "reserved"]
    assert len(rows) == 1 and rows[0]["reserved_nusd"] > 0
    (killed,) = rows
    # the watchdog reloads the router; the key's next admission after the reservation's deadline
    # + margin abandons it
    while time.time() < killed["expires_at"] + 0.5:
        time.sleep(0.2)
    deadline = time.monotonic() + 60
    while True:
        status, _, body = http_route(server.http_url, "general_llm", HELLO, secret=SECRETS["open"])
        if status == 200:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.5)
    store = ledger(setup)
    after = [r for r in store.rows("WHERE id = ?", (killed["id"],))]
    assert len(after) == 1 and after[0]["status"] == "abandoned" and after[0]["cost_nusd"] == killed["reserved_nusd"]
    # one charge for the killed request: any other attempt of it (a fallback) failed, at zero
    others = [r for r in store.rows() if r["request_id"] == killed["request_id"] and r["id"] != killed["id"]]
    assert all(r["status"] == "failed" and r["cost_nusd"] == 0 for r in others), others


def test_two_replicas_share_the_sqlite_ledger_under_16_clients(setup, fake):
    """--replicas 2: two tritonservers (two router processes) on one SQLite file, 16 concurrent
    clients on one key: the budget holds within one call."""
    fake.reset()
    replicated = start(setup, fake, replicas=2)
    costs, lock = [], threading.Lock()

    def client():
        while True:
            status, _, body = http_route(replicated.http_url, "general_llm", {"text": "hi", "tier": "best"},
                                         secret=SECRETS["replicas"])
            if status != 200:
                assert status == 429, body
                return
            with lock:
                costs.append(Decimal(str(body["result"]["usage"]["cost_usd"])))

    try:
        threads = [threading.Thread(target=client) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    finally:
        replicated.stop()
    rows = ledger(setup).rows("WHERE key_name = ?", ("team-replicas",))
    assert len({row["replica"] for row in rows}) == 2  # both routers served and wrote
    total = sum(row["cost_nusd"] for row in rows)
    assert total == nano_usd(sum(costs)) and nano_usd("0.003") <= total <= nano_usd("0.003") + nano_usd(costs[0])


def test_spend_survives_a_restart(setup, fake, server):
    """Last: the module's server stops, a new one on the same ledger still refuses the spent key."""
    for _ in range(60):  # spent already when the budget test ran first
        if http_route(server.http_url, "general_llm", {"text": "hi", "tier": "best"},
                      secret=SECRETS["budget"])[0] == 429:
            break
    server.stop()
    again = start(setup, fake)
    try:
        status, headers, body = http_route(again.http_url, "general_llm", {"text": "hi", "tier": "best"},
                                           secret=SECRETS["budget"])
        assert status == 429 and "team-budget" in body["error"]
        status, _, _ = http_route(again.http_url, "general_llm", HELLO, secret=SECRETS["open"])
        assert status == 200
        text = prometheus_text.scrape(again.metrics_url)
        assert prometheus_text.total(prometheus_text.parse_samples(text), "router_budget_remaining_usd",
                                     key_name="team-budget") == 0
        for secret in SECRETS.values():
            assert secret not in text
    finally:
        again.stop()
    log = setup[3].read_text(errors="replace")
    for secret in list(SECRETS.values()) + [GATEWAY_KEY]:
        assert secret not in log
    for row in ledger(setup).rows():
        assert all(secret not in json.dumps(row) for secret in SECRETS.values())
