"""Where the gateway's calls and refusals are recorded: the metrics sink (``SpendRecorder``) and
the keys' budget gauges read from the spend ledger."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Callable, Protocol

from triton_pipelines.gateway.keys import ApiKey, KeyRing
from triton_pipelines.gateway.ledger import KeyLimits, SpendLedger, usd


class SpendRecorder(Protocol):
    """Metrics sink (the router's RouterMetrics implements it)."""

    def spend(self, key_name: str, model: str, cost_usd: float) -> None: ...

    def budget(self, key_name: str, remaining_usd: float | None, window_spend_usd: float,
               soft_budget_usd: float | None) -> None: ...

    def fallback(self, from_model: str, to_model: str, reason: str) -> None: ...

    def cooldown(self, model: str) -> None: ...

    def refusal(self, key_name: str, reason: str) -> None: ...

    def overspend(self, key_name: str, model: str, over_usd: float) -> None:
        """A call settled above its reservation (``Admission.settle_success``): by how much."""


class NullRecorder:
    def spend(self, *args) -> None: pass

    def budget(self, *args) -> None: pass

    def fallback(self, *args) -> None: pass

    def cooldown(self, *args) -> None: pass

    def refusal(self, *args) -> None: pass

    def overspend(self, *args) -> None: pass


class BudgetGauges:
    """The keys' budget gauges (remaining, spent in the window, soft budget) from the ledger."""

    def __init__(self, keys: KeyRing | None, ledger: SpendLedger | None, recorder: SpendRecorder,
                 log: Callable[[str], None]):
        self.keys, self.ledger, self.recorder, self.log = keys, ledger, recorder, log

    def publish_all(self) -> None:
        """Set the budget gauges of every key from the ledger (at start, and for the report)."""
        if self.keys is None or self.ledger is None:
            return
        try:
            for key in self.keys:
                self.publish(key)
        except Exception as error:  # the gauges wait for the next call; serving does not
            self.log(f"gateway: could not read the spend ledger for the budget gauges ({type(error).__name__})")

    async def refresh(self, key: ApiKey | None) -> None:
        """The key's budget gauges after a call; a ledger that cannot be read now costs the gauge,
        not the answer."""
        if key is None or self.ledger is None:
            return
        try:
            await asyncio.to_thread(self.publish, key)
        except Exception as error:
            self.log(f"gateway: could not read the spend of key {key.name} ({type(error).__name__})")

    def publish(self, key: ApiKey | None) -> None:
        if key is None or self.ledger is None or (key.max_budget_usd is None and key.soft_budget_usd is None):
            return
        spend = self.ledger.key_spend(KeyLimits.of(key))
        committed = usd(spend.committed_nusd)
        remaining = None if key.max_budget_usd is None else float(max(key.max_budget_usd - committed, Decimal(0)))
        self.recorder.budget(key.name, remaining, float(committed),
                             None if key.soft_budget_usd is None else float(key.soft_budget_usd))
