"""The spend ledger: every gateway call's key, task, model, tokens, cost, latency and outcome in a
database, and the one place where a key's budget, rpm and tpm are checked.

One interface, two stores: SQLite (the default, a file in the launcher's state folder:
``sqlite:///<state dir>/spend.db``) and PostgreSQL (``SPEND_DATABASE_URL=postgresql://...``, so
that several replicas or hosts share one budget).

**Reservation, then settlement.** ``admit`` runs in one transaction that holds the key's lock
(SQLite: ``BEGIN IMMEDIATE``, the database's write lock; PostgreSQL: ``SELECT ... FOR UPDATE`` of
the key's row in ``spend_keys``): it checks the budget (spend in the key's current window plus the
reservations still outstanding), rpm and tpm, and inserts a ``reserved`` row carrying the most the
call may cost (prompt tokens estimated from above, ``max_tokens`` of output, at the model's price).
After the call, ``settle`` UPDATEs that same row, by id, to what the gateway reported
(``success``) or to zero (``failed``: a failed call is charged nothing unless the provider reported
usage). Settlement is an update of one row, so nothing is charged twice; a crash between the
gateway's answer and ``settle`` leaves the row ``reserved``, which counts against the budget at
its reserved (upper-bound) cost, so no charge is lost. After ``expires_at`` (the request's
deadline plus a margin) a reservation still outstanding is *abandoned*: settled at its reserved
cost (the call may well have been answered and billed upstream). A late ``settle`` of an abandoned
row still replaces the estimate with the real figures.

**Windows.** A budget's window is aligned on the Unix epoch in UTC: ``budget_period: 1d`` resets
at 00:00 UTC, ``1h`` on the hour, ``30d`` every 30 days counted from 1970-01-01 (not calendar
months). A call belongs to the window in which it was admitted. rpm and tpm count the last 60
seconds (rolling); a refusal says when the window reopens (``retry_after_s``).

Amounts are integers of nano-dollars (1e-9 USD), exact in both databases: a price with up to three
decimals per million tokens is exact per token; finer prices are rounded up.

The database itself (its URL, connection, schema, transactions, dialects) is ``ledger_db.py``.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any, Callable, Iterable, Sequence

from triton_pipelines.gateway.ledger_db import CHARGED, TOKENS, LedgerDatabase, redacted_url

NANO = 10**9
RATE_WINDOW_S = 60.0
# What a reservation may outlive its request's deadline by before it is abandoned.
RESERVATION_MARGIN_S = 60.0
ANONYMOUS_NAME = "anonymous"
STATUSES = ("reserved", "success", "failed", "abandoned")


def nano_usd(amount: Decimal | float | int | str) -> int:
    """US dollars → nano-dollars, rounded up."""
    return int((Decimal(str(amount)) * NANO).to_integral_value(rounding=ROUND_CEILING))


def usd(nusd: int) -> Decimal:
    return Decimal(int(nusd)) / NANO


def call_cost_nusd(input_per_million: Decimal, output_per_million: Decimal, input_tokens: int,
                   output_tokens: int) -> int:
    """Exact cost of a call in nano-dollars (USD per million tokens → nano-dollars per token is × 1000)."""
    return nano_usd((Decimal(input_tokens) * input_per_million + Decimal(output_tokens) * output_per_million)
                    / Decimal(1_000_000))


def window_bounds(now: float, period_s: int | None) -> tuple[float, float | None]:
    """The budget window holding ``now``: [start, end); no period: [0, never)."""
    if not period_s:
        return 0.0, None
    start = math.floor(now / period_s) * period_s
    return float(start), float(start + period_s)


@dataclass(frozen=True)
class KeyLimits:
    """What the ledger needs of a key (``api_keys.ApiKey`` has these fields; None: anonymous)."""
    key_id: str
    name: str
    max_budget_usd: Decimal | None = None
    budget_period_s: int | None = None
    rpm: int | None = None
    tpm: int | None = None

    @classmethod
    def of(cls, api_key) -> "KeyLimits":
        if api_key is None:
            return ANONYMOUS
        return cls(api_key.key_id, api_key.name, api_key.max_budget_usd, api_key.budget_period_s,
                   api_key.rpm, api_key.tpm)

    @property
    def limited(self) -> bool:
        return self.max_budget_usd is not None or self.rpm is not None or self.tpm is not None


ANONYMOUS = KeyLimits("", ANONYMOUS_NAME)


class LimitExceeded(Exception):
    """A key's budget, rpm or tpm is reached. ``limit``: ``budget`` | ``rpm`` | ``tpm``;
    ``retry_after_s``: when the window reopens (None: never, a budget without a period)."""

    def __init__(self, key_name: str, limit: str, allowed: Any, used: Any, retry_after_s: float | None):
        self.key_name, self.limit, self.allowed, self.used = key_name, limit, allowed, used
        self.retry_after_s = retry_after_s
        if limit == "budget":
            text = (f"key {key_name} has reached its budget of ${allowed} (spent and reserved in this window: "
                    f"${used})")
            text += (f"; the window resets in {math.ceil(retry_after_s)} s" if retry_after_s is not None
                     else "; the budget has no period: raise max_budget_usd to serve it again")
        else:
            unit = "requests" if limit == "rpm" else "tokens"
            text = (f"key {key_name} has reached its {limit} limit of {allowed} {unit} per minute "
                    f"({used} in the last 60 s); retry in {math.ceil(retry_after_s or 0)} s")
        super().__init__(text)


@dataclass(frozen=True)
class KeySpend:
    key_id: str
    key_name: str
    spent_nusd: int  # settled (success, failed with usage, abandoned) in the window
    reserved_nusd: int  # outstanding reservations in the window
    window_start: float
    window_end: float | None

    @property
    def committed_nusd(self) -> int:
        return self.spent_nusd + self.reserved_nusd


class SpendLedger:
    """Budgets, rpm and tpm over one ``ledger_db.LedgerDatabase`` (one connection, one lock per
    process); safe to call from any thread (the router calls it from worker threads:
    ``asyncio.to_thread``)."""

    def __init__(self, url: str, clock: Callable[[], float] = time.time, replica: str | None = None):
        self.url = url
        self.clock = clock
        self.replica = replica or f"{socket.gethostname()}:{os.getpid()}"
        self.db = LedgerDatabase(url)

    def __repr__(self) -> str:
        return f"SpendLedger({redacted_url(self.url)!r})"

    def close(self) -> None:
        self.db.close()

    # ----------------------------------------------------------------------------- admission
    def admit(self, key: KeyLimits, *, request_id: str, task: str, model: str, reserved_nusd: int,
              reserved_tokens: int, expires_in_s: float, counts_request: bool = True,
              check_rates: bool = True, trace_id: str | None = None) -> int:
        """Check the key's budget, rpm and tpm and insert a reservation, atomically; the row's id.
        Raises LimitExceeded. ``counts_request``: this row counts toward rpm (a fallback attempt of
        the same request does not); ``check_rates``: False checks the budget only (a fallback
        attempt: the request was already admitted by rpm and tpm)."""

        def body() -> int:
            now = self.clock()
            if key.limited:
                self.db.lock_key(key.key_id, key.name, now)
            self._reap(now, key.key_id)  # this key's reservations past their deadline: abandoned
            if key.limited:
                self._check(key, now, counts_request, check_rates)
            return self._insert(key, request_id, task, model, reserved_nusd, reserved_tokens, now,
                                now + expires_in_s, counts_request, trace_id)

        return self.db.transaction(body)

    def _check(self, key: KeyLimits, now: float, counts_request: bool, check_rates: bool) -> None:
        if key.max_budget_usd is not None:
            start, end = window_bounds(now, key.budget_period_s)
            (committed,) = self.db.execute(f"SELECT COALESCE(SUM({CHARGED}), 0) FROM spend_log "
                                         f"WHERE key_id = ? AND started_at >= ?", (key.key_id, start)).fetchone()
            if int(committed) >= nano_usd(key.max_budget_usd):
                raise LimitExceeded(key.name, "budget", key.max_budget_usd, usd(int(committed)).normalize(),
                                    None if end is None else max(end - now, 1.0))
        if not check_rates:
            return
        since = now - RATE_WINDOW_S
        if key.rpm is not None and counts_request:
            rows = self.db.execute("SELECT started_at FROM spend_log WHERE key_id = ? AND counts_request = 1 "
                                 "AND started_at > ? ORDER BY started_at", (key.key_id, since)).fetchall()
            if len(rows) >= key.rpm:
                reopens = rows[len(rows) - key.rpm][0] + RATE_WINDOW_S
                raise LimitExceeded(key.name, "rpm", key.rpm, len(rows), max(reopens - now, 1.0))
        if key.tpm is not None:
            rows = self.db.execute(f"SELECT started_at, {TOKENS} FROM spend_log WHERE key_id = ? AND started_at > ? "
                                 f"ORDER BY started_at", (key.key_id, since)).fetchall()
            used = sum(int(tokens) for _, tokens in rows)
            if used >= key.tpm:
                left, reopens = used, now
                for started, tokens in rows:  # oldest first, until what stays is under the limit
                    left -= int(tokens)
                    reopens = started + RATE_WINDOW_S
                    if left < key.tpm:
                        break
                raise LimitExceeded(key.name, "tpm", key.tpm, used, max(reopens - now, 1.0))

    def _insert(self, key: KeyLimits, request_id: str, task: str, model: str, reserved_nusd: int,
                reserved_tokens: int, now: float, expires_at: float, counts_request: bool,
                trace_id: str | None = None) -> int:
        columns = ("request_id, key_id, key_name, task, model, status, counts_request, started_at, expires_at, "
                   "reserved_nusd, reserved_tokens, replica, trace_id")
        values = (request_id, key.key_id, key.name, task, model, "reserved", int(counts_request), now, expires_at,
                  int(reserved_nusd), int(reserved_tokens), self.replica, trace_id)
        sql = f"INSERT INTO spend_log ({columns}) VALUES ({', '.join('?' * len(values))})"
        return self.db.insert(sql, values)

    # ----------------------------------------------------------------------------- settlement
    def settle(self, row_id: int, *, status: str, input_tokens: int | None = None, output_tokens: int | None = None,
               cost_nusd: int = 0, latency_s: float | None = None, outcome: str = "",
               fallback_from: str | None = None, fallback_reason: str | None = None) -> bool:
        """Settle one reservation (idempotent: an UPDATE of that row; a row already settled is left
        alone, an abandoned one gets the real figures). False if nothing was updated."""
        if status not in ("success", "failed"):
            raise ValueError(f"settle: status must be success or failed, not {status!r}")

        def body() -> bool:
            cursor = self.db.execute(
                "UPDATE spend_log SET status = ?, input_tokens = ?, output_tokens = ?, cost_nusd = ?, latency_s = ?, "
                "outcome = ?, fallback_from = ?, fallback_reason = ?, settled_at = ? "
                "WHERE id = ? AND status IN ('reserved', 'abandoned')",
                (status, input_tokens, output_tokens, int(cost_nusd), latency_s, outcome, fallback_from,
                 fallback_reason, self.clock(), int(row_id)))
            return cursor.rowcount == 1

        return self.db.transaction(body)

    def _reap(self, now: float, key_id: str | None = None) -> int:
        sql = ("UPDATE spend_log SET status = 'abandoned', cost_nusd = reserved_nusd, settled_at = ?, "
               "outcome = 'abandoned' WHERE status = 'reserved' AND expires_at < ?")
        parameters: list = [now, now]
        if key_id is not None:
            sql += " AND key_id = ?"
            parameters.append(key_id)
        return self.db.execute(sql, parameters).rowcount

    def reap(self) -> int:
        """Abandon every reservation past its ``expires_at`` (charged at its reserved cost)."""
        return self.db.transaction(lambda: self._reap(self.clock()))

    # ----------------------------------------------------------------------------- reading
    def key_spend(self, key: KeyLimits) -> KeySpend:
        now = self.clock()
        start, end = window_bounds(now, key.budget_period_s)
        ((spent, reserved),) = self.db.read(
            "SELECT COALESCE(SUM(CASE WHEN status = 'reserved' THEN 0 ELSE COALESCE(cost_nusd, 0) END), 0), "
            "COALESCE(SUM(CASE WHEN status = 'reserved' THEN reserved_nusd ELSE 0 END), 0) "
            "FROM spend_log WHERE key_id = ? AND started_at >= ?", (key.key_id, start))
        return KeySpend(key.key_id, key.name, int(spent), int(reserved), start, end)

    def rows(self, where: str = "", parameters: Sequence = ()) -> list[dict]:
        """Ledger rows as dicts (tests, the report command)."""
        cursor_rows = self.db.read(f"SELECT id, request_id, key_id, key_name, task, model, status, counts_request, "
                                 f"started_at, expires_at, settled_at, reserved_nusd, reserved_tokens, input_tokens, "
                                 f"output_tokens, cost_nusd, latency_s, outcome, fallback_from, fallback_reason, "
                                 f"replica, trace_id FROM spend_log {where} ORDER BY id", parameters)
        names = ("id", "request_id", "key_id", "key_name", "task", "model", "status", "counts_request", "started_at",
                 "expires_at", "settled_at", "reserved_nusd", "reserved_tokens", "input_tokens", "output_tokens",
                 "cost_nusd", "latency_s", "outcome", "fallback_from", "fallback_reason", "replica", "trace_id")
        return [dict(zip(names, row)) for row in cursor_rows]

    def summary(self, group_by: Iterable[str] = ("key", "model", "day"), since: float | None = None,
                until: float | None = None) -> list[dict]:
        """Spend grouped by any of key, model, task, day (UTC) and status."""
        columns = {"key": "key_name", "model": "model", "task": "task", "status": "status",
                   "day": self.db.day}
        groups = list(group_by)
        unknown = [g for g in groups if g not in columns]
        if unknown:
            raise ValueError(f"cannot group by {unknown}; choose among {sorted(columns)}")
        where, parameters = [], []
        if since is not None:
            where.append("started_at >= ?")
            parameters.append(since)
        if until is not None:
            where.append("started_at < ?")
            parameters.append(until)
        selected = [f"{columns[g]} AS g{i}" for i, g in enumerate(groups)]
        sql = (f"SELECT {', '.join(selected + [''])}COUNT(*), "
               f"COALESCE(SUM(CASE WHEN status = 'success' THEN 1 ELSE 0 END), 0), "
               f"COALESCE(SUM(COALESCE(input_tokens, 0)), 0), COALESCE(SUM(COALESCE(output_tokens, 0)), 0), "
               f"COALESCE(SUM({CHARGED}), 0) FROM spend_log"
               + (f" WHERE {' AND '.join(where)}" if where else "")
               + (f" GROUP BY {', '.join(f'g{i}' for i in range(len(groups)))}"
                  f" ORDER BY {', '.join(f'g{i}' for i in range(len(groups)))}" if groups else ""))
        result = []
        for row in self.db.read(sql, parameters):
            entry: dict[str, Any] = {}
            for i, group in enumerate(groups):
                value = row[i]
                entry[group] = time.strftime("%Y-%m-%d", time.gmtime(int(value) * 86400)) if group == "day" else value
            calls, succeeded, tokens_in, tokens_out, charged = row[len(groups):]
            entry.update(calls=int(calls), succeeded=int(succeeded), input_tokens=int(tokens_in),
                         output_tokens=int(tokens_out), cost_usd=usd(int(charged)))
            result.append(entry)
        return result
