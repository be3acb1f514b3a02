"""Fallbacks: what a failed attempt means for the rest of a request's chain (the next model, a
larger context window, or the error itself), cooldowns of models whose circuit opened, and the
error of a request no model answered."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from triton_pipelines.errors import RouteError
from triton_pipelines.gateway.keys import ApiKey
from triton_pipelines.gateway.recorder import SpendRecorder
from triton_pipelines.gateway.upstream import GatewayClient

# Failures that send the request on to the next model of its chain.
FALLBACK_REASONS = frozenset({"upstream_status", "timeout", "unreachable", "bad_response", "circuit_open"})


@dataclass(frozen=True)
class Attempt:
    model: str
    outcome: str  # success | cooldown | <RouteError reason>
    http_status: int | None = None


def fallback_label(attempt: Attempt) -> str:
    """A failed attempt as a fallback reason: rate_limited (429), upstream_error (5xx), timeout,
    unreachable, bad_response, cooldown (open circuit), context_window."""
    if attempt.outcome == "upstream_status":
        return "rate_limited" if attempt.http_status == 429 else "upstream_error"
    if attempt.outcome == "circuit_open":
        return "cooldown"
    return attempt.outcome


class Fallbacks:
    """A request's way down its chain of models; ``larger_window(task, model, chain)`` is the route
    table's model with a larger context window, ``settle(row, status, **figures)`` the admission's."""

    def __init__(self, client: GatewayClient, larger_window: Callable[..., str | None],
                 settle: Callable[..., Awaitable[None]], recorder: SpendRecorder):
        self.client, self.larger_window, self.settle, self.recorder = client, larger_window, settle, recorder

    async def after_failure(self, error: RouteError, row: int | None, current: str, chain: list[str],
                            attempts: list[Attempt], started: float, was_open: bool, task: str | None,
                            api_key: ApiKey | None) -> list[str]:
        """After ``current`` failed: its reservation settled at zero, a cooldown noted, and the rest
        of the chain to try (a context-window error: a larger window first); raises ``error`` when
        it is not one to fall back on."""
        await self.settle(row, "failed", latency_s=time.monotonic() - started, outcome=error.reason)
        if not was_open and self.client.breaker(current).state == "open":
            self.recorder.cooldown(current)
        attempts.append(Attempt(current, error.reason, getattr(error, "http_status", None)))
        if error.reason == "context_window":
            larger = self.larger_window(task, current, chain)
            if larger is None or (api_key is not None and not api_key.allows_model(larger)):
                raise error
            return [larger] + [m for m in chain if m != larger]
        if error.reason not in FALLBACK_REASONS:
            raise error
        return chain

    def exhausted(self, attempts: list[Attempt], last_error: RouteError | None, budget_s: float) -> RouteError:
        """The error of a request no model of its chain answered."""
        tried = ", ".join(f"{a.model}: {fallback_label(a)}" for a in attempts) or "none"
        if last_error is not None:
            error = RouteError(last_error.reason, f"{last_error} (models tried: {tried})", last_error.retry_after_s)
        elif attempts:
            retry = min((self.client.breaker(a.model).retry_in_s() for a in attempts), default=None)
            error = RouteError("circuit_open", f"circuit open for every model of this request, cooling down after "
                                               f"repeated failures ({tried}): retry in {math.ceil(retry or 1)} s",
                               retry)
        else:
            error = RouteError("timeout", f"no answer within the request's deadline of {budget_s:g} s")
        return error
