"""A request's admission against the spend ledger when its caller leaves during it (a streamed chat
whose client disconnects while the ledger admits): the row the ledger made is settled, never sent
and uncharged, instead of staying `reserved` until it is reaped and charged (issue 33 §1)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from triton_pipelines.gateway.admission import Admission, Plan
from triton_pipelines.gateway.ledger import ANONYMOUS, SpendLedger
from triton_pipelines.repository.routes import RouteTable

from tests.support.paths import PROJECT_ROOT


class Recorder:
    def __getattr__(self, name):
        return lambda *args: None


def test_an_admission_its_caller_leaves_settles_its_row_uncharged(tmp_path):
    table = RouteTable.load(PROJECT_ROOT / "data" / "routes.yaml")
    ledger = SpendLedger(f"sqlite:///{tmp_path / 'spend.db'}")
    admitted_in_thread = threading.Event()
    admit = ledger.admit

    def slow_admit(*args, **kwargs):
        row = admit(*args, **kwargs)
        admitted_in_thread.set()
        time.sleep(0.3)  # the caller is cancelled while the thread still holds the row id
        return row

    ledger.admit = slow_admit
    admission = Admission(table.prices, ledger, 2.0, Recorder(), lambda line: None, table.output_limit)
    plan = Plan("gpt-4.1", ANONYMOUS, ("gpt-4.1",), time.monotonic() + 30, 30.0, "req-1", 10, 100)

    async def leave_during_admission():
        task = asyncio.ensure_future(admission.admit(plan, "chat", "gpt-4.1", 30.0, True, []))
        while not admitted_in_thread.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave_during_admission())
    (row,) = ledger.rows()
    assert (row["status"], row["cost_nusd"], row["outcome"]) == ("failed", 0, "client_left")
