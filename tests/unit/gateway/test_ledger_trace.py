"""The trace id in the spend ledger: stored with each row, shown by the spend report, and added
to a ledger created before the column existed (SQLite and PostgreSQL)."""

from __future__ import annotations

import sqlite3

import pytest

from triton_pipelines.gateway import ledger_db
from triton_pipelines.gateway.ledger import KeyLimits, SpendLedger
from triton_pipelines.ops.spend_report import main

TRACE = "0af7651916cd43dd8448eb211c80319c"
OLD_SCHEMA = ledger_db.SCHEMA.replace(",\n    trace_id TEXT", "")


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'spend.db'}"
    server = request.getfixturevalue("postgres_server")
    return server.database(f"trace_{request.node.name.split('[')[0][-40:]}".lower())


def create_old_ledger(url: str) -> None:
    assert "trace_id" not in OLD_SCHEMA
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url[len("sqlite:///"):])
        conn.executescript(OLD_SCHEMA.format(serial="INTEGER PRIMARY KEY AUTOINCREMENT"))
        conn.execute("INSERT INTO spend_log (request_id, key_id, key_name, task, model, status, counts_request, "
                     "started_at, expires_at, reserved_nusd, reserved_tokens, replica) "
                     "VALUES ('old', 'k', 'team-old', '', 'gpt-4.1', 'success', 1, 1, 2, 5, 5, 'r')")
        conn.commit()
        conn.close()
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        for statement in OLD_SCHEMA.format(serial="BIGSERIAL PRIMARY KEY").split(";"):
            if statement.strip():
                conn.execute(statement)


def test_rows_keep_their_trace_id_and_an_old_ledger_gets_the_column(url):
    create_old_ledger(url)
    ledger = SpendLedger(url)  # the column is added at start
    try:
        limits = KeyLimits("ab" * 32, "team-a")
        row = ledger.admit(limits, request_id="chatcmpl-1", task="", model="gpt-4.1", reserved_nusd=1000,
                           reserved_tokens=10, expires_in_s=60, trace_id=TRACE)
        ledger.settle(row, status="success", cost_nusd=900, input_tokens=3, output_tokens=4)
        untraced = ledger.admit(limits, request_id="chatcmpl-2", task="", model="gpt-4.1", reserved_nusd=1000,
                                reserved_tokens=10, expires_in_s=60)
        by_request = {r["request_id"]: r for r in ledger.rows()}
        assert by_request["chatcmpl-1"]["trace_id"] == TRACE
        assert by_request["chatcmpl-2"]["trace_id"] is None and untraced
    finally:
        ledger.close()
    SpendLedger(url).close()  # a second start finds the column there


def test_the_spend_report_lists_the_last_calls_with_their_trace_ids(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'spend.db'}"
    ledger = SpendLedger(url)
    limits = KeyLimits("ab" * 32, "team-a")
    for index in range(3):
        row = ledger.admit(limits, request_id=f"req-{index}", task="", model="gpt-4.1", reserved_nusd=1000,
                           reserved_tokens=10, expires_in_s=60, trace_id=f"{index:032x}")
        ledger.settle(row, status="success", cost_nusd=900)
    ledger.close()
    assert main(["--database", url, "--calls", "2", "--format", "json"]) == 0
    import json

    calls = json.loads(capsys.readouterr().out)["calls"]
    assert [(c["request_id"], c["trace_id"]) for c in calls] == [("req-1", f"{1:032x}"), ("req-2", f"{2:032x}")]
    assert main(["--database", url, "--calls", "1"]) == 0
    assert f"{2:032x}" in capsys.readouterr().out
