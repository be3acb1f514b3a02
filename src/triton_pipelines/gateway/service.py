"""The gateway as a service: a key's limits, the spend ledger, fallbacks and cooldowns around
``gateway.GatewayClient``. The router's gateway path and the OpenAI-compatible frontend both call it.

    service = GatewayService.from_environment(RouteTable.load("data/routes.yaml"), state_dir=...)
    answer = service.complete(api_key, task=None, model="gpt-4.1", messages=[...], max_tokens=200)
    answer.text, answer.model, answer.cost_usd, answer.fallback_from, answer.fallback_reason

One request:

1. **Who**: with a keys file (``$TRITON_API_KEYS_FILE``) a request needs a known key
   (``GatewayRefusal`` 401); a model outside the key's ``models`` is refused (403).
2. **Which models**: the requested one (or the task's choice by tier), then its fallback chain
   (``RouteTable.fallback_chain``), without models the key may not use. A model whose circuit is
   open is *cooling down* and skipped (reason ``cooldown``).
3. **Admission** (``SpendLedger.admit``, one transaction): budget, rpm, tpm; refused → 429 with the
   key's name, the limit and ``retry_after_s``. Admitted → a reservation row (the most the call can
   cost: prompt tokens bounded from above, ``max_tokens`` of output, at that model's price).
4. **The call** (``GatewayClient.complete``: time-outs, retries, breaker) within the request's one
   deadline. Success → the reservation is settled with the reported usage and its exact cost.
   Failure → settled at zero; on 429, 5xx, time-out, unreachable, an unreadable answer or an open
   circuit the next model of the chain is tried (admitted again: budget only, the request was
   already counted by rpm and tpm); a context-window error goes to a model with a larger window.
5. **The answer** names the model that answered, the model asked for and why it fell back.

Blocking database calls run in worker threads (``asyncio.to_thread``), never on the event loop.
``acomplete`` is for callers on an event loop (the router's stub); ``complete`` and ``stream`` for
threads (they run on the service's own event loop thread). One service serves one of the two.

The service is the façade; its collaborators do one job each: ``access`` (who may call which
model), ``admission`` (the plan, reservations and settlements against the ledger), ``fallback``
(the chain, cooldowns, the error when no model answered), ``streaming`` (the streamed call),
``recorder`` (metrics and budget gauges), ``refusal`` (GatewayRefusal).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator, Mapping

from triton_pipelines.gateway.keys import ApiKey, KeyRing, keys_from_environment
from triton_pipelines.errors import InputError, RouteError, check_encodable
from triton_pipelines.gateway.upstream import MIN_ATTEMPT_S, GatewayClient
from triton_pipelines.repository.routes import RoutedRequest, RouteTable, choose_model, estimate_prompt_tokens
from triton_pipelines.gateway.ledger import KeyLimits, SpendLedger, call_cost_nusd, usd
from triton_pipelines.gateway.ledger_db import database_url, redacted_url
from triton_pipelines.gateway.access import Access
from triton_pipelines.gateway.admission import Admission, Plan
from triton_pipelines.gateway.fallback import Attempt, Fallbacks, fallback_label
from triton_pipelines.gateway.recorder import BudgetGauges, NullRecorder, SpendRecorder
from triton_pipelines.gateway.streaming import StreamRelay, blocking
from triton_pipelines.telemetry import tracing
from triton_pipelines.telemetry.genai import gateway_answered, gateway_failed, gateway_span, traced_stream


@dataclass
class GatewayAnswer:
    text: str
    model: str  # the model that answered
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal  # exact, from the usage the gateway reported
    requested_model: str
    fallback_from: str | None  # the requested model, when another one answered
    fallback_reason: str | None  # why the first model did not answer (rate_limited, upstream_error, ...)
    key_name: str
    request_id: str
    attempts: list[Attempt] = field(default_factory=list)
    finish_reason: str | None = None

    def usage(self) -> dict:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cost_usd": float(self.cost_usd)}


def resolve_model(table: RouteTable, task: str | None, model: str | None, tier: str | None) -> str:
    """The model a request asks for: its own, or its task's choice by tier (InputError when neither serves)."""
    if task is not None:
        route = table.tasks.get(task)
        if route is None or route.route != "gateway":
            raise InputError(f"task {task!r} is not a gateway task")
        chosen = model or choose_model(route, table.prices, tier)
        if chosen not in route.models:
            raise InputError(f"model {chosen!r} does not serve task {task} (its models: {', '.join(route.models)})")
        return chosen
    if not model:
        raise InputError("a gateway request names a model or a task")
    if model not in table.prices:
        raise InputError(f"unknown model {model!r}; gateway models: {', '.join(sorted(table.prices))}")
    return model


class GatewayService:
    def __init__(self, table: RouteTable, client: GatewayClient, ledger: SpendLedger | None = None,
                 keys: KeyRing | None = None, recorder: SpendRecorder | None = None,
                 log: Callable[[str], None] = lambda message: None):
        self.table = table
        self.client = client
        self.ledger = ledger
        self.keys = keys
        self._recorder = recorder or NullRecorder()
        self.log = log
        if keys is not None and ledger is None and any(k.max_budget_usd is not None or k.rpm or k.tpm for k in keys):
            raise ValueError("the keys file sets budgets or rate limits, but there is no spend ledger: set "
                             "SPEND_DATABASE_URL (the launcher sets sqlite:///<state dir>/spend.db)")
        self.access = Access(keys, self.recorder)
        self.gauges = BudgetGauges(keys, ledger, self.recorder, log)
        self.admission = Admission(table.prices, ledger, table.gateway.reservation_margin_s, self.recorder, log,
                                   table.output_limit)
        self.fallbacks = Fallbacks(client, table.larger_window, self.admission.settle, self.recorder)
        self.relay = StreamRelay(table.prices, self.admission, self.recorder, self.gauges)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()

    @classmethod
    def from_environment(cls, table: RouteTable, state_dir: Path | str | None = None,
                         environ: Mapping[str, str] | None = None, recorder: SpendRecorder | None = None,
                         log: Callable[[str], None] = lambda message: None) -> "GatewayService":
        """Keys from ``$TRITON_API_KEYS_FILE``, the ledger from ``$SPEND_DATABASE_URL`` (else
        SQLite in ``state_dir``), the gateway from ``$LLM_GATEWAY_BASE_URL``/``_API_KEY``."""
        keys = keys_from_environment(environ)
        url = database_url(state_dir, environ)
        ledger = SpendLedger(url) if url else None
        if ledger is not None:
            reaped = ledger.reap()
            log(f"gateway: spend ledger {redacted_url(url)}" + (f"; {reaped} stale reservation(s) abandoned "
                                                                 f"at their reserved cost" if reaped else ""))
        return cls(table, GatewayClient(table.gateway, environ), ledger, keys, recorder, log)

    @property
    def recorder(self) -> SpendRecorder:
        """Where calls, refusals and budgets are recorded; set later by a process whose metrics exist
        after the service (the /v1 frontend): every collaborator records to the new one."""
        return self._recorder

    @recorder.setter
    def recorder(self, recorder: SpendRecorder) -> None:
        self._recorder = recorder
        for part in (self.access, self.gauges, self.admission, self.fallbacks, self.relay):
            part.recorder = recorder

    # ----------------------------------------------------------------------------- keys
    @property
    def models(self) -> list[str]:
        """Every gateway model (priced in the route file)."""
        return sorted(self.table.prices)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """``Authorization`` header value → the key; None when no keys file is configured.
        GatewayRefusal 401 for a missing or unknown key when one is."""
        return self.access.authenticate(authorization)

    def key_by_id(self, key_id: str | None) -> ApiKey | None:
        """A key id forwarded by the request screen → the key (None without a keys file)."""
        return self.access.key_by_id(key_id)

    def publish_budgets(self) -> None:
        """Set the budget gauges of every key from the ledger (at start, and for the report)."""
        self.gauges.publish_all()

    # ----------------------------------------------------------------------------- sync API
    def _own_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="gateway-service", daemon=True)
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop

    def complete(self, api_key: ApiKey | None, *, messages: list[dict], task: str | None = None,
                 model: str | None = None, max_tokens: int | None = None, temperature: float | None = None,
                 tier: str | None = None, deadline_s: float | None = None,
                 request_id: str | None = None) -> GatewayAnswer:
        """``acomplete`` from a thread (blocks until the answer or the exception)."""
        future = asyncio.run_coroutine_threadsafe(
            self.acomplete(api_key, messages=messages, task=task, model=model, max_tokens=max_tokens,
                           temperature=temperature, tier=tier, deadline_s=deadline_s, request_id=request_id),
            self._own_loop())
        return future.result()

    def close(self) -> None:
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self.client.close(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=5)
            self._loop = None
        if self.ledger is not None:
            self.ledger.close()

    # ----------------------------------------------------------------------------- one request
    async def acomplete(self, api_key: ApiKey | None, *, messages: list[dict], task: str | None = None,
                        model: str | None = None, max_tokens: int | None = None, temperature: float | None = None,
                        tier: str | None = None, deadline_s: float | None = None,
                        request_id: str | None = None) -> GatewayAnswer:
        """One chat completion under the key's limits, with fallbacks; raises GatewayRefusal (not
        served: 401/403/429), InputError (bad request, 400) or RouteError (the gateway failed on
        every model tried; ``reason`` as GatewayClient's, ``context_window`` when no larger window)."""
        plan = self._plan(api_key, messages, task, model, max_tokens, tier, deadline_s, request_id)
        requested, limits, chain, deadline, budget_s = (plan.requested, plan.limits, list(plan.chain), plan.deadline,
                                                        plan.budget_s)
        request_id = plan.request_id
        attempts: list[Attempt] = []
        admitted_once = False
        last_error: RouteError | None = None
        while chain:
            current = chain.pop(0)
            breaker = self.client.breaker(current)
            if breaker.state == "open":
                attempts.append(Attempt(current, "cooldown"))  # cooling down: skipped without a call
                continue
            remaining = deadline - time.monotonic()
            if remaining < MIN_ATTEMPT_S:
                break
            row = await self.admission.admit(plan, task, current, remaining, first=not admitted_once,
                                             attempts=attempts)
            admitted_once = True
            routed = RoutedRequest(task or "", "gateway", "realtime", current, current, messages=messages,
                                   temperature=temperature, max_tokens=self.admission.max_tokens(plan, current))
            was_open = breaker.state == "open"
            started = time.monotonic()
            span = gateway_span(current, limits.name, request_id, routed.max_tokens)  # None unless tracing
            try:
                completion = await self.client.complete(routed, remaining)
            except RouteError as error:
                gateway_failed(span, error.reason, str(error))
                chain = await self.fallbacks.after_failure(error, row, current, chain, attempts, started, was_open,
                                                           task, api_key)
                last_error = error
                continue
            price = self.table.prices[current]
            cost = call_cost_nusd(price.input_per_million, price.output_per_million, completion.input_tokens,
                                  completion.output_tokens)
            first_failure = next((a for a in attempts), None)
            reason = fallback_label(first_failure) if first_failure and current != requested else None
            await self.admission.settle_success(row, plan, current, cost, input_tokens=completion.input_tokens,
                                                output_tokens=completion.output_tokens,
                                                latency_s=time.monotonic() - started,
                                                fallback_from=requested if current != requested else None,
                                                fallback_reason=reason)
            attempts.append(Attempt(current, "success"))
            gateway_answered(span, current, completion.input_tokens, completion.output_tokens, usd(cost), requested,
                             reason)
            if current != requested:
                self.recorder.fallback(requested, current, reason or "unknown")
            self.recorder.spend(limits.name, current, float(usd(cost)))
            await self.gauges.refresh(api_key)
            return GatewayAnswer(completion.text, current, completion.input_tokens, completion.output_tokens,
                                 usd(cost), requested, requested if current != requested else None, reason,
                                 limits.name, request_id, attempts)
        raise self.fallbacks.exhausted(attempts, last_error, budget_s)

    def _plan(self, api_key: ApiKey | None, messages: list[dict], task: str | None, model: str | None,
              max_tokens: int | None, tier: str | None, deadline_s: float | None, request_id: str | None) -> Plan:
        """Who may call which models, within which deadline, reserving how many tokens."""
        check_encodable(messages, "messages")
        requested = resolve_model(self.table, task, model, tier)
        self.access.check(api_key, requested)
        settings = self.table.gateway
        budget_s = deadline_s if deadline_s is not None else (
            self.table.deadline_s(task) if task else settings.deadline_s)
        chain = tuple(m for m in self.table.fallback_chain(task, requested)
                      if api_key is None or api_key.allows_model(m))
        return Plan(requested, KeyLimits.of(api_key), chain, time.monotonic() + budget_s, budget_s,
                     request_id or uuid.uuid4().hex, estimate_prompt_tokens(messages, settings.image_tokens_estimate),
                     max_tokens, tracing.trace_id())  # the caller's trace (its ledger rows name it)

    # ----------------------------------------------------------------------------- streaming
    def stream(self, api_key: ApiKey | None, *, messages: list[dict], task: str | None = None,
               model: str | None = None, max_tokens: int | None = None, temperature: float | None = None,
               tier: str | None = None, deadline_s: float | None = None,
               request_id: str | None = None) -> Iterator[dict]:
        """``astream`` from a thread: a blocking iterator of the same chunks. Refusals and failures
        before the first chunk raise from the first ``next()``. Closing it early (``close()``, a
        client that went away) stops the upstream stream and settles the call."""
        loop = self._own_loop()
        yield from blocking(self.astream(api_key, messages=messages, task=task, model=model, max_tokens=max_tokens,
                                         temperature=temperature, tier=tier, deadline_s=deadline_s,
                                         request_id=request_id), loop)

    async def astream(self, api_key: ApiKey | None, *, messages: list[dict], task: str | None = None,
                      model: str | None = None, max_tokens: int | None = None, temperature: float | None = None,
                      tier: str | None = None, deadline_s: float | None = None,
                      request_id: str | None = None) -> AsyncIterator[dict]:
        """A streamed chat completion under the key's limits: OpenAI ``chat.completion.chunk``
        dicts as the gateway sends them (their own ``usage`` removed), then one last chunk with no
        choices whose ``usage`` holds ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
        ``cost_usd``, and whose ``x_gateway`` names ``model``, ``requested_model``,
        ``fallback_from``, ``fallback_reason``, ``request_id``. The first chunk carries the same
        ``x_gateway`` (which model answers and why is known before any text: fallbacks happen only
        before the first chunk), so that a caller can say it up front (response headers). A stream
        that breaks after it, or that reports no usage, is charged its reservation (tokens went
        out; the real figure is unknown)."""
        plan = self._plan(api_key, messages, task, model, max_tokens, tier, deadline_s, request_id)
        chain, attempts, last_error, admitted_once = list(plan.chain), [], None, False
        while chain:
            current = chain.pop(0)
            if self.client.breaker(current).state == "open":
                attempts.append(Attempt(current, "cooldown"))
                continue
            remaining = plan.deadline - time.monotonic()
            if remaining < MIN_ATTEMPT_S:
                break
            row = await self.admission.admit(plan, task, current, remaining, first=not admitted_once,
                                             attempts=attempts)
            admitted_once = True
            routed = RoutedRequest(task or "", "gateway", "realtime", current, current, messages=messages,
                                   temperature=temperature, max_tokens=self.admission.max_tokens(plan, current))
            started = time.monotonic()
            was_open = self.client.breaker(current).state == "open"
            span = gateway_span(current, plan.limits.name, plan.request_id, routed.max_tokens)  # None unless tracing
            try:
                call = await self.client.open_stream(routed, remaining)
            except RouteError as error:
                gateway_failed(span, error.reason, str(error))
                chain = await self.fallbacks.after_failure(error, row, current, chain, attempts, started, was_open,
                                                           task, api_key)
                last_error = error
                continue
            except BaseException:  # closed or cancelled before the first chunk (the client left): the
                # request went out, the figure is unknown: its reservation, now rather than when abandoned
                gateway_failed(span, "stream_interrupted")
                await self.admission.settle(row, "failed", cost_nusd=self.admission.reserved(plan, current),
                                            latency_s=time.monotonic() - started, outcome="stream_interrupted")
                raise
            relay = traced_stream(span, current, self.relay.relay(call, row, plan, current, attempts, started, api_key))
            try:
                async for item in relay:
                    yield item
            finally:  # closed now, not by the garbage collector: the settlement runs before we return
                await relay.aclose()
            return
        raise self.fallbacks.exhausted(attempts, last_error, plan.budget_s)
