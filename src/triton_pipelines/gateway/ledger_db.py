"""The spend ledger's database: where it is (``$SPEND_DATABASE_URL``, else SQLite in the state
folder), its connection (SQLite in WAL mode, or PostgreSQL through psycopg, reconnected once when
lost), its schema, its write transactions and what differs between the two dialects (the key's
lock, an insert's new id, a day of ``started_at``). ``ledger.SpendLedger`` holds the budget, rpm
and tpm logic on top of it."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import unquote, urlparse

DATABASE_ENV = "SPEND_DATABASE_URL"

SCHEMA = """
CREATE TABLE IF NOT EXISTS spend_keys (
    key_id TEXT PRIMARY KEY,
    key_name TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS spend_log (
    id {serial},
    request_id TEXT NOT NULL,
    key_id TEXT NOT NULL,
    key_name TEXT NOT NULL,
    task TEXT NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    counts_request INTEGER NOT NULL,
    started_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    settled_at DOUBLE PRECISION,
    reserved_nusd BIGINT NOT NULL,
    reserved_tokens BIGINT NOT NULL,
    input_tokens BIGINT,
    output_tokens BIGINT,
    cost_nusd BIGINT,
    latency_s DOUBLE PRECISION,
    outcome TEXT,
    fallback_from TEXT,
    fallback_reason TEXT,
    replica TEXT NOT NULL,
    trace_id TEXT
);
CREATE INDEX IF NOT EXISTS spend_log_key_started ON spend_log (key_id, started_at);
CREATE INDEX IF NOT EXISTS spend_log_status_expires ON spend_log (status, expires_at);
"""
# Columns added after a ledger's first release: added to a database that predates them, at start
# (table, column, type). trace_id: the request's OpenTelemetry trace (telemetry/tracing.py).
ADDED_COLUMNS = (("spend_log", "trace_id", "TEXT"),)
# What a row counts against a budget: its reservation while outstanding, else what it cost.
CHARGED = "(CASE WHEN status = 'reserved' THEN reserved_nusd ELSE COALESCE(cost_nusd, 0) END)"
TOKENS = ("(CASE WHEN status = 'reserved' THEN reserved_tokens "
          "ELSE COALESCE(input_tokens, 0) + COALESCE(output_tokens, 0) END)")


def database_url(state_dir: Path | str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPEND_DATABASE_URL``, else ``sqlite:///<state_dir>/spend.db``, else None (no ledger)."""
    environ = os.environ if environ is None else environ
    url = environ.get(DATABASE_ENV, "").strip()
    if url:
        return url
    return f"sqlite:///{Path(state_dir).resolve() / 'spend.db'}" if state_dir else None


def redacted_url(url: str) -> str:
    """The URL without its password (for logs)."""
    parsed = urlparse(url)
    if parsed.password:
        netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@")
        return parsed._replace(netloc=netloc).geturl()
    return url


class LedgerDatabase:
    """One connection, one lock per process; safe to call from any thread."""

    def __init__(self, url: str):
        self.url = url
        self._lock = threading.Lock()
        scheme = urlparse(url).scheme
        if scheme == "sqlite":
            self.dialect = "sqlite"
        elif scheme in ("postgresql", "postgres"):
            self.dialect = "postgresql"
        else:
            raise ValueError(f"{DATABASE_ENV}: unsupported database {redacted_url(url)!r}: use sqlite:///<path> "
                             f"or postgresql://user:password@host:port/database")
        self._conn = None
        with self._lock:
            self._connect()
            self._create()

    # ----------------------------------------------------------------------------- connection
    def _connect(self) -> None:
        if self.dialect == "sqlite":
            # sqlite:///relative/path or sqlite:////absolute/path (SQLAlchemy's form)
            path = unquote(self.url[len("sqlite:///"):]) if self.url.startswith("sqlite:///") else ""
            if not path:
                raise ValueError(f"{DATABASE_ENV}: {self.url!r} names no file: sqlite:///<path>")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA busy_timeout=30000")
            self._conn = conn
        else:
            import psycopg

            self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=10)

    def _sql(self, text: str) -> str:
        return text if self.dialect == "sqlite" else text.replace("?", "%s")

    def execute(self, text: str, parameters: Sequence = ()):
        return self._conn.execute(self._sql(text), tuple(parameters))

    def _create(self) -> None:
        serial = "INTEGER PRIMARY KEY AUTOINCREMENT" if self.dialect == "sqlite" else "BIGSERIAL PRIMARY KEY"
        statements = [s.strip() for s in SCHEMA.format(serial=serial).split(";") if s.strip()]
        if self.dialect == "sqlite":
            self._conn.executescript(";\n".join(statements) + ";")
            self._conn.execute("BEGIN IMMEDIATE")  # several processes may start on one file at once
            try:
                for table, column, kind in ADDED_COLUMNS:
                    present = {row[1] for row in self._conn.execute(f"PRAGMA table_info({table})")}
                    if column not in present:
                        self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            finally:
                self._conn.execute("COMMIT")
        else:
            with self._conn.transaction():
                # concurrent first starts of several replicas: one creates, the others wait
                self._conn.execute("SELECT pg_advisory_xact_lock(7482931)")
                for statement in statements:
                    self._conn.execute(statement)
                for table, column, kind in ADDED_COLUMNS:
                    self._conn.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {kind}")

    def transaction(self, body: Callable[[], Any]) -> Any:
        """``body`` inside one write transaction (SQLite: the database's write lock from the start)."""
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self.dialect == "sqlite":
                        self._conn.execute("BEGIN IMMEDIATE")
                        try:
                            result = body()
                        except BaseException:
                            self._conn.execute("ROLLBACK")
                            raise
                        self._conn.execute("COMMIT")
                        return result
                    with self._conn.transaction():
                        return body()
                except Exception as error:
                    if attempt == 0 and self._lost(error):
                        self._reconnect()
                        continue
                    raise
        raise AssertionError("unreachable")

    def _lost(self, error: Exception) -> bool:
        if self.dialect != "postgresql":
            return False
        import psycopg

        return isinstance(error, psycopg.OperationalError) and (self._conn.closed or self._conn.broken)

    def _reconnect(self) -> None:
        try:
            self._conn.close()
        except Exception:
            pass
        self._connect()

    def read(self, text: str, parameters: Sequence = ()) -> list[tuple]:
        return self.transaction(lambda: list(self.execute(text, parameters).fetchall()))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # ----------------------------------------------------------------------------- dialects
    def lock_key(self, key_id: str, key_name: str, now: float) -> None:
        """The key's row in ``spend_keys``, locked for this transaction (SQLite: the write lock
        already is the key's lock)."""
        if self.dialect == "sqlite":
            self.execute("INSERT OR IGNORE INTO spend_keys (key_id, key_name, created_at) VALUES (?, ?, ?)",
                         (key_id, key_name, now))
            return
        self.execute("INSERT INTO spend_keys (key_id, key_name, created_at) VALUES (?, ?, ?) "
                     "ON CONFLICT (key_id) DO NOTHING", (key_id, key_name, now))
        self.execute("SELECT key_id FROM spend_keys WHERE key_id = ? FOR UPDATE", (key_id,)).fetchall()

    def insert(self, sql: str, values: Sequence) -> int:
        """An ``INSERT`` of one row → its new id."""
        if self.dialect == "sqlite":
            return int(self.execute(sql, values).lastrowid)
        return int(self.execute(sql + " RETURNING id", values).fetchone()[0])

    @property
    def day(self) -> str:
        """The UTC day (days since the epoch) of a row's ``started_at``, as SQL."""
        return ("CAST(started_at / 86400 AS INTEGER)" if self.dialect == "sqlite"
                else "CAST(FLOOR(started_at / 86400) AS BIGINT)")
