"""A request's admission against the spend ledger: its plan (which models, which deadline, how
many tokens reserved), the reservation of one attempt (``SpendLedger.admit``: budget, rpm, tpm;
refused → ``GatewayRefusal`` 429) and its settlement. Blocking database calls run in worker
threads (``asyncio.to_thread``), never on the event loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from triton_pipelines.errors import RouteError
from triton_pipelines.gateway.fallback import Attempt, fallback_label
from triton_pipelines.gateway.ledger import KeyLimits, LimitExceeded, SpendLedger, call_cost_nusd, usd
from triton_pipelines.gateway.recorder import SpendRecorder
from triton_pipelines.gateway.refusal import GatewayRefusal


@dataclass(frozen=True)
class Plan:
    requested: str
    limits: KeyLimits
    chain: tuple
    deadline: float
    budget_s: float
    request_id: str
    prompt_tokens: int
    max_tokens: int | None  # None: each model's output limit (``RouteTable.output_limit``)
    trace_id: str | None = None  # the request's trace (telemetry/tracing.py), stored in its ledger rows


class Admission:
    """Reservations and settlements of a service's calls (no ledger: every call is admitted)."""

    def __init__(self, prices: dict, ledger: SpendLedger | None, reservation_margin_s: float,
                 recorder: SpendRecorder, log: Callable[[str], None], output_limit: Callable[[str], int]):
        self.prices, self.ledger, self.reservation_margin_s = prices, ledger, reservation_margin_s
        self.recorder, self.log = recorder, log
        self.output_limit = output_limit

    def max_tokens(self, plan: Plan, model: str) -> int:
        """The output tokens one attempt on ``model`` is sent (and reserved): the request's
        ``max_tokens``, else the model's output limit."""
        return plan.max_tokens if plan.max_tokens is not None else self.output_limit(model)

    def reserved(self, plan: Plan, model: str) -> int:
        """The most one attempt of ``plan`` on ``model`` can cost (nano-dollars): its prompt's bound
        and the output it is sent as ``max_tokens``, at the model's price."""
        price = self.prices[model]
        return call_cost_nusd(price.input_per_million, price.output_per_million, plan.prompt_tokens,
                              self.max_tokens(plan, model))

    async def admit(self, plan: Plan, task: str | None, model: str, remaining_s: float, first: bool,
                    attempts: list[Attempt]) -> int | None:
        """The reservation row of one attempt; ``first``: the request's first, checked by rpm and tpm
        too (a fallback attempt: the budget only)."""
        if self.ledger is None:
            return None
        limits = plan.limits
        admitted = asyncio.ensure_future(asyncio.to_thread(
            self.ledger.admit, limits, request_id=plan.request_id, task=task or "", model=model,
            reserved_nusd=self.reserved(plan, model), reserved_tokens=plan.prompt_tokens + self.max_tokens(plan, model),
            expires_in_s=remaining_s + self.reservation_margin_s,
            counts_request=first, check_rates=first, trace_id=plan.trace_id))
        try:
            return await asyncio.shield(admitted)
        except asyncio.CancelledError:
            # The caller left (a streamed chat's client) while the ledger admitted: the row exists once
            # the thread is done. Settle it now, never sent and uncharged, instead of leaving it
            # `reserved` (blocking budget, rpm and tpm until reaped, then charged in full).
            await asyncio.shield(self._release(admitted))
            raise
        except LimitExceeded as exceeded:
            reason = "over_budget" if exceeded.limit == "budget" else "rate_limited"
            self.recorder.refusal(limits.name, reason)
            message = str(exceeded)
            if attempts:
                message += f" (while falling back from {attempts[0].model}: {fallback_label(attempts[0])})"
            raise GatewayRefusal(429, reason, message, exceeded.retry_after_s, limit=exceeded.limit) from None
        except Exception as error:  # the database is down: fail closed, the budget cannot be checked
            self.log(f"gateway: spend ledger unavailable ({type(error).__name__}: {error})")
            raise RouteError("ledger_unavailable", "the spend ledger is unavailable, so the key's budget cannot "
                                                   "be checked: retry shortly") from None

    async def _release(self, admitted: asyncio.Future) -> None:
        """Settle the row an abandoned admission made (if it made one) as failed at no cost."""
        try:
            row = await admitted
        except Exception:  # refused or the ledger failed: no row was made
            return
        await self.settle(row, "failed", cost_nusd=0, outcome="client_left")

    async def settle_success(self, row: int | None, plan: Plan, model: str, cost_nusd: int, outcome: str = "success",
                             **figures: Any) -> None:
        """Settle a call the upstream answered at ``cost_nusd``, in full. A cost above the call's
        reservation (the upstream counted more prompt than its bound: text the provider adds, an
        image above the route file's bound) is flagged: a log line, the recorder's ``overspend``
        and the row's outcome (``<outcome>_over_reservation``); it counts against the key's budget
        at once (settled rows are the key's spend)."""
        reserved = self.reserved(plan, model)
        if cost_nusd > reserved:
            outcome += "_over_reservation"
            self.log(f"gateway: key {plan.limits.name}'s call {plan.request_id} to {model} cost {usd(cost_nusd)} USD, "
                     f"above its reservation of {usd(reserved)} USD (input tokens {figures.get('input_tokens')} for "
                     f"a bound of {plan.prompt_tokens}; output {figures.get('output_tokens')} for "
                     f"{self.max_tokens(plan, model)}): charged in full")
            self.recorder.overspend(plan.limits.name, model, float(usd(cost_nusd - reserved)))
        await self.settle(row, "success", cost_nusd=cost_nusd, outcome=outcome, **figures)

    async def settle(self, row: int | None, status: str, **figures: Any) -> None:
        if row is None or self.ledger is None:
            return
        try:
            await asyncio.to_thread(self.ledger.settle, row, status=status, **figures)
        except Exception as error:  # the reservation stays and is abandoned at its reserved cost
            self.log(f"gateway: could not settle spend ledger row {row} ({type(error).__name__}: {error}); "
                     f"its reservation stands")
