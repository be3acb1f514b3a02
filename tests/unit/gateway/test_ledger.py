"""The spend ledger (spend_ledger.py) against a real SQLite file and a real PostgreSQL server:
reservation and settlement, budgets in aligned windows, rpm/tpm in the last 60 s with Retry-After,
abandoned reservations, restarts, and concurrent admission from separate connections (replicas)."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest

from triton_pipelines.gateway.ledger import (KeyLimits, LimitExceeded, SpendLedger, call_cost_nusd, nano_usd, usd,
                                           window_bounds)
from triton_pipelines.gateway.ledger_db import database_url


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'spend.db'}"
    server = request.getfixturevalue("postgres_server")
    return server.database(f"ledger_{request.node.name.split('[')[0][-40:]}".lower())


def key(**limits) -> KeyLimits:
    return KeyLimits("ab" * 32, "team-a", **limits)


def admit(ledger: SpendLedger, limits: KeyLimits, reserved_nusd: int = 1000, tokens: int = 100, **extra) -> int:
    return ledger.admit(limits, request_id=extra.pop("request_id", "r"), task="general_llm", model="gpt-4.1",
                        reserved_nusd=reserved_nusd, reserved_tokens=tokens, expires_in_s=extra.pop("expires", 60),
                        **extra)


def test_cost_is_exact_in_nano_dollars():
    assert call_cost_nusd(Decimal("8.00"), Decimal("8.00"), 11, 7) == 144_000  # $0.000144
    assert call_cost_nusd(Decimal("0.42"), Decimal("1.68"), 11, 7) == 16_380
    assert usd(16_380) == Decimal("0.00001638")
    assert nano_usd("0.005") == 5_000_000
    assert nano_usd(Decimal("1e-10")) == 1  # rounded up


def test_windows_are_aligned_on_the_epoch():
    assert window_bounds(3600 * 5 + 10, 3600) == (3600 * 5, 3600 * 6)
    assert window_bounds(86400 * 3 + 1, 86400) == (86400 * 3, 86400 * 4)
    assert window_bounds(123.0, None) == (0.0, None)


def test_database_url_defaults_to_the_state_folder(tmp_path):
    assert database_url(tmp_path, {}) == f"sqlite:///{tmp_path.resolve() / 'spend.db'}"
    assert database_url(tmp_path, {"SPEND_DATABASE_URL": "postgresql://u@h/d"}) == "postgresql://u@h/d"
    assert database_url(None, {}) is None
    with pytest.raises(ValueError, match="unsupported database"):
        SpendLedger("mysql://u:secret@h/d")


def test_budget_refuses_once_spend_and_reservations_reach_it(url):
    clock = Clock()
    ledger = SpendLedger(url, clock=clock)
    limits = key(max_budget_usd=Decimal("0.005"))
    charged = 0
    rows = []
    for _ in range(100):
        try:
            row = admit(ledger, limits, reserved_nusd=2_000_000)  # $0.002 reserved per call
        except LimitExceeded as refused:
            assert refused.limit == "budget" and "team-a" in str(refused) and "$0.005" in str(refused)
            assert refused.retry_after_s is None  # no period: never reopens by itself
            break
        rows.append(row)
        assert ledger.settle(row, status="success", input_tokens=500, output_tokens=500, cost_nusd=1_500_000)
        charged += 1_500_000
    # 0, 1.5, 3.0, 4.5 m$ were below the budget when admitted: 4 calls, $0.006 ≤ budget + one call
    assert len(rows) == 4 and charged == 6_000_000
    assert ledger.key_spend(limits).committed_nusd == charged <= nano_usd("0.005") + 1_500_000
    ledger.close()


def test_outstanding_reservations_count_and_settlement_is_idempotent(url):
    clock = Clock()
    ledger = SpendLedger(url, clock=clock)
    limits = key(max_budget_usd=Decimal("0.005"))
    first = admit(ledger, limits, reserved_nusd=3_000_000)
    second = admit(ledger, limits, reserved_nusd=3_000_000)  # 3 m$ committed < 5 m$: admitted
    with pytest.raises(LimitExceeded):
        admit(ledger, limits)  # 6 m$ committed (reserved, in flight)
    assert ledger.settle(first, status="success", input_tokens=10, output_tokens=10, cost_nusd=100_000)
    assert not ledger.settle(first, status="success", input_tokens=10, output_tokens=10, cost_nusd=100_000)
    assert ledger.settle(second, status="failed", outcome="timeout")  # failed: charged nothing
    assert ledger.key_spend(limits).committed_nusd == 100_000
    assert [r["status"] for r in ledger.rows()] == ["success", "failed"]
    ledger.close()


def test_a_reservation_never_settled_is_abandoned_at_its_reserved_cost(url):
    clock = Clock()
    ledger = SpendLedger(url, clock=clock)
    limits = key(max_budget_usd=Decimal("1"))
    row = admit(ledger, limits, reserved_nusd=7_000, expires=30)
    clock.now += 31
    assert ledger.reap() == 1
    (entry,) = ledger.rows()
    assert (entry["status"], entry["cost_nusd"], entry["outcome"]) == ("abandoned", 7_000, "abandoned")
    assert ledger.key_spend(limits).spent_nusd == 7_000  # no charge lost
    # a late settlement replaces the estimate with the real figures (still one row: none doubled)
    assert ledger.settle(row, status="success", input_tokens=3, output_tokens=4, cost_nusd=500)
    assert ledger.key_spend(limits).spent_nusd == 500 and len(ledger.rows()) == 1
    ledger.close()


def test_budget_window_resets_and_says_when(url):
    clock = Clock(3600 * 1000 + 600)  # 10 minutes into an hour
    ledger = SpendLedger(url, clock=clock)
    limits = key(max_budget_usd=Decimal("0.001"), budget_period_s=3600)
    row = admit(ledger, limits, reserved_nusd=2_000_000)
    ledger.settle(row, status="success", input_tokens=1, output_tokens=1, cost_nusd=1_000_000)
    with pytest.raises(LimitExceeded) as refused:
        admit(ledger, limits)
    assert refused.value.retry_after_s == pytest.approx(3000)
    assert "resets in 3000 s" in str(refused.value)
    clock.now += 3000  # the next window
    admit(ledger, limits)
    ledger.close()


def test_rpm_counts_requests_of_the_last_minute(url):
    clock = Clock()
    ledger = SpendLedger(url, clock=clock)
    limits = key(rpm=3)
    for step in range(3):
        admit(ledger, limits, request_id=f"r{step}")
        clock.now += 10
    admit(ledger, limits, request_id="r2", counts_request=False, check_rates=False)  # a fallback attempt
    with pytest.raises(LimitExceeded) as refused:
        admit(ledger, limits, request_id="r3")
    assert refused.value.limit == "rpm" and "rpm limit of 3" in str(refused.value)
    assert refused.value.retry_after_s == pytest.approx(30)  # the first leaves the window at +60
    clock.now += 30.5
    admit(ledger, limits, request_id="r4")
    ledger.close()


def test_tpm_counts_reserved_then_used_tokens(url):
    clock = Clock()
    ledger = SpendLedger(url, clock=clock)
    limits = key(tpm=1000)
    first = admit(ledger, limits, tokens=600)
    clock.now += 5
    admit(ledger, limits, tokens=600)  # 600 < 1000: admitted
    clock.now += 5
    with pytest.raises(LimitExceeded) as refused:
        admit(ledger, limits, tokens=10)
    assert refused.value.limit == "tpm" and refused.value.retry_after_s == pytest.approx(50)
    ledger.settle(first, status="success", input_tokens=100, output_tokens=100, cost_nusd=1)
    admit(ledger, limits, tokens=10)  # settled at 200 used tokens: 800 < 1000
    ledger.close()


def test_spend_survives_a_restart(url):
    clock = Clock()
    ledger = SpendLedger(url, clock=clock)
    limits = key(max_budget_usd=Decimal("0.001"))
    ledger.settle(admit(ledger, limits), status="success", input_tokens=1, output_tokens=1, cost_nusd=1_000_000)
    ledger.close()
    again = SpendLedger(url, clock=clock)
    assert again.key_spend(limits).spent_nusd == 1_000_000
    with pytest.raises(LimitExceeded):
        admit(again, limits)
    again.close()


def test_concurrent_replicas_cannot_jointly_overspend(url):
    """Four ledgers (four connections: replicas or hosts) × 4 threads admit and settle against one
    budget: the total never exceeds it by more than one call's reservation."""
    clock = Clock()
    limits = key(max_budget_usd=Decimal("0.01"))
    ledgers = [SpendLedger(url, clock=clock, replica=f"r{i}") for i in range(4)]
    reservation, cost = 300_000, 250_000

    def client(ledger: SpendLedger) -> None:
        while True:
            try:
                row = admit(ledger, limits, reserved_nusd=reservation)
            except LimitExceeded:
                return
            ledger.settle(row, status="success", input_tokens=1, output_tokens=1, cost_nusd=cost)

    threads = [threading.Thread(target=client, args=(ledgers[i % 4],)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    total = ledgers[0].key_spend(limits).committed_nusd
    # served up to the budget (less what the last in-flight reservations overestimated), never past it + one call
    assert nano_usd("0.01") - 16 * (reservation - cost) <= total <= nano_usd("0.01") + reservation
    assert all(r["status"] == "success" for r in ledgers[0].rows())
    for ledger in ledgers:
        ledger.close()


def test_summary_groups_by_key_model_and_day(url):
    clock = Clock(86400 * 20000 + 10)
    ledger = SpendLedger(url, clock=clock)
    limits = key()
    ledger.settle(admit(ledger, limits), status="success", input_tokens=5, output_tokens=6, cost_nusd=1_000)
    ledger.settle(admit(ledger, limits), status="failed", outcome="timeout")
    (row,) = ledger.summary(("key", "model", "day"))
    assert row == {"key": "team-a", "model": "gpt-4.1", "day": "2024-10-04", "calls": 2, "succeeded": 1,
                   "input_tokens": 5, "output_tokens": 6, "cost_usd": Decimal("0.000001")}
    ledger.close()
