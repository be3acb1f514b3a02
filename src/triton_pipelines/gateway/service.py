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
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Protocol

from triton_pipelines.gateway.keys import ApiKey, KeyRing, keys_from_environment
from triton_pipelines.errors import REFUSAL_STATUSES, InputError, RouteError, refusal_text
from triton_pipelines.gateway.upstream import MIN_ATTEMPT_S, GatewayClient
from triton_pipelines.repository.routes import RoutedRequest, RouteTable, choose_model, estimate_prompt_tokens
from triton_pipelines.gateway.ledger import (KeyLimits, LimitExceeded, SpendLedger, call_cost_nusd, database_url, redacted_url,
                           usd)

# Failures that send the request on to the next model of its chain.
FALLBACK_REASONS = frozenset({"upstream_status", "timeout", "unreachable", "bad_response", "circuit_open"})


@dataclass(frozen=True)
class _Plan:
    requested: str
    limits: KeyLimits
    chain: tuple
    deadline: float
    budget_s: float
    request_id: str
    prompt_tokens: int
    max_tokens: int


class GatewayRefusal(Exception):
    """A request refused before the gateway is called: by its key (missing or unknown: 401; a
    model it may not use: 403) or by a limit of its key (budget, rpm, tpm: 429).

    ``reason`` is the metric label (``unauthenticated``, ``model_not_allowed``, ``over_budget``,
    ``rate_limited``), ``limit`` the key's limit that refused (``budget``, ``rpm``, ``tpm``). Each
    transport maps it once: gRPC by ``errors.REFUSAL_STATUSES``, /v1 by ``openai_api.protocol.REFUSALS``."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float | None = None,
                 limit: str = ""):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message
        self.grpc_code = REFUSAL_STATUSES[status]
        self.retry_after_s = None if retry_after_s is None else float(max(1, math.ceil(retry_after_s)))
        self.limit = limit

    def marked(self) -> str:
        """The message with the marker the request screen turns into this status (errors.py)."""
        return refusal_text(self.status, self.message, self.retry_after_s)


@dataclass(frozen=True)
class Attempt:
    model: str
    outcome: str  # success | cooldown | <RouteError reason>
    http_status: int | None = None


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


class SpendRecorder(Protocol):
    """Metrics sink (the router's RouterMetrics implements it)."""

    def spend(self, key_name: str, model: str, cost_usd: float) -> None: ...

    def budget(self, key_name: str, remaining_usd: float | None, window_spend_usd: float,
               soft_budget_usd: float | None) -> None: ...

    def fallback(self, from_model: str, to_model: str, reason: str) -> None: ...

    def cooldown(self, model: str) -> None: ...

    def refusal(self, key_name: str, reason: str) -> None: ...


class NullRecorder:
    def spend(self, *args) -> None: pass

    def budget(self, *args) -> None: pass

    def fallback(self, *args) -> None: pass

    def cooldown(self, *args) -> None: pass

    def refusal(self, *args) -> None: pass


def fallback_label(attempt: Attempt) -> str:
    """A failed attempt as a fallback reason: rate_limited (429), upstream_error (5xx), timeout,
    unreachable, bad_response, cooldown (open circuit), context_window."""
    if attempt.outcome == "upstream_status":
        return "rate_limited" if attempt.http_status == 429 else "upstream_error"
    if attempt.outcome == "circuit_open":
        return "cooldown"
    return attempt.outcome


class GatewayService:
    def __init__(self, table: RouteTable, client: GatewayClient, ledger: SpendLedger | None = None,
                 keys: KeyRing | None = None, recorder: SpendRecorder | None = None,
                 log: Callable[[str], None] = lambda message: None):
        self.table = table
        self.client = client
        self.ledger = ledger
        self.keys = keys
        self.recorder = recorder or NullRecorder()
        self.log = log
        if keys is not None and ledger is None and any(k.max_budget_usd is not None or k.rpm or k.tpm for k in keys):
            raise ValueError("the keys file sets budgets or rate limits, but there is no spend ledger: set "
                             "SPEND_DATABASE_URL (the launcher sets sqlite:///<state dir>/spend.db)")
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

    # ----------------------------------------------------------------------------- keys
    @property
    def models(self) -> list[str]:
        """Every gateway model (priced in the route file)."""
        return sorted(self.table.prices)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """``Authorization`` header value → the key; None when no keys file is configured.
        GatewayRefusal 401 for a missing or unknown key when one is."""
        from triton_pipelines.gateway.keys import bearer_secret

        if self.keys is None:
            return None
        secret = bearer_secret(authorization)
        key = self.keys.lookup(secret) if secret else None
        if key is None:
            raise self._unauthenticated("missing" if secret is None else "unknown")
        return key

    def key_by_id(self, key_id: str | None) -> ApiKey | None:
        """A key id forwarded by the request screen → the key (None without a keys file)."""
        if self.keys is None:
            return None
        key = self.keys.by_id(key_id) if key_id else None
        if key is None:
            raise self._unauthenticated("missing" if not key_id else "unknown")
        return key

    def _unauthenticated(self, which: str) -> GatewayRefusal:
        self.recorder.refusal("unknown", "unauthenticated")
        text = ("gateway requests need an API key: send `Authorization: Bearer <key>`" if which == "missing"
                else "the API key is not known to this server")
        return GatewayRefusal(401, "unauthenticated", text)

    def publish_budgets(self) -> None:
        """Set the budget gauges of every key from the ledger (at start, and for the report)."""
        if self.keys is None or self.ledger is None:
            return
        try:
            for key in self.keys:
                self._publish_budget(key)
        except Exception as error:  # the gauges wait for the next call; serving does not
            self.log(f"gateway: could not read the spend ledger for the budget gauges ({type(error).__name__})")

    async def _refresh_budget(self, key: ApiKey | None) -> None:
        """The key's budget gauges after a call; a ledger that cannot be read now costs the gauge,
        not the answer."""
        if key is None or self.ledger is None:
            return
        try:
            await asyncio.to_thread(self._publish_budget, key)
        except Exception as error:
            self.log(f"gateway: could not read the spend of key {key.name} ({type(error).__name__})")

    def _publish_budget(self, key: ApiKey | None) -> None:
        if key is None or self.ledger is None or (key.max_budget_usd is None and key.soft_budget_usd is None):
            return
        spend = self.ledger.key_spend(KeyLimits.of(key))
        committed = usd(spend.committed_nusd)
        remaining = None if key.max_budget_usd is None else float(max(key.max_budget_usd - committed, Decimal(0)))
        self.recorder.budget(key.name, remaining, float(committed),
                             None if key.soft_budget_usd is None else float(key.soft_budget_usd))

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
    def _resolve(self, task: str | None, model: str | None, tier: str | None) -> str:
        if task is not None:
            route = self.table.tasks.get(task)
            if route is None or route.route != "gateway":
                raise InputError(f"task {task!r} is not a gateway task")
            chosen = model or choose_model(route, self.table.prices, tier)
            if chosen not in route.models:
                raise InputError(f"model {chosen!r} does not serve task {task} (its models: {', '.join(route.models)})")
            return chosen
        if not model:
            raise InputError("a gateway request names a model or a task")
        if model not in self.table.prices:
            raise InputError(f"unknown model {model!r}; gateway models: {', '.join(self.models)}")
        return model

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
        request_id, prompt_tokens, max_tokens = plan.request_id, plan.prompt_tokens, plan.max_tokens
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
            row = await self._admit(limits, api_key, request_id, task, current, prompt_tokens, max_tokens,
                                    remaining, first=not admitted_once, attempts=attempts)
            admitted_once = True
            routed = RoutedRequest(task or "", "gateway", "realtime", current, current, messages=messages,
                                   temperature=temperature, max_tokens=max_tokens)
            was_open = breaker.state == "open"
            started = time.monotonic()
            try:
                completion = await self.client.complete(routed, remaining)
            except RouteError as error:
                chain = await self._fall_back(error, row, current, chain, attempts, started, was_open, task, api_key)
                last_error = error
                continue
            price = self.table.prices[current]
            cost = call_cost_nusd(price.input_per_million, price.output_per_million, completion.input_tokens,
                                  completion.output_tokens)
            first_failure = next((a for a in attempts), None)
            reason = fallback_label(first_failure) if first_failure and current != requested else None
            await self._settle(row, "success", input_tokens=completion.input_tokens,
                               output_tokens=completion.output_tokens, cost_nusd=cost,
                               latency_s=time.monotonic() - started, outcome="success",
                               fallback_from=requested if current != requested else None, fallback_reason=reason)
            attempts.append(Attempt(current, "success"))
            if current != requested:
                self.recorder.fallback(requested, current, reason or "unknown")
            self.recorder.spend(limits.name, current, float(usd(cost)))
            await self._refresh_budget(api_key)
            return GatewayAnswer(completion.text, current, completion.input_tokens, completion.output_tokens,
                                 usd(cost), requested, requested if current != requested else None, reason,
                                 limits.name, request_id, attempts)
        raise self._exhausted(attempts, last_error, budget_s)

    async def _fall_back(self, error: RouteError, row: int | None, current: str, chain: list[str],
                         attempts: list[Attempt], started: float, was_open: bool, task: str | None,
                         api_key: ApiKey | None) -> list[str]:
        """After ``current`` failed: its reservation settled at zero, a cooldown noted, and the rest
        of the chain to try (a context-window error: a larger window first); raises ``error`` when
        it is not one to fall back on."""
        await self._settle(row, "failed", latency_s=time.monotonic() - started, outcome=error.reason)
        if not was_open and self.client.breaker(current).state == "open":
            self.recorder.cooldown(current)
        attempts.append(Attempt(current, error.reason, getattr(error, "http_status", None)))
        if error.reason == "context_window":
            larger = self.table.larger_window(task, current, chain)
            if larger is None or (api_key is not None and not api_key.allows_model(larger)):
                raise error
            return [larger] + [m for m in chain if m != larger]
        if error.reason not in FALLBACK_REASONS:
            raise error
        return chain

    def _exhausted(self, attempts: list[Attempt], last_error: RouteError | None, budget_s: float) -> RouteError:
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

    def _plan(self, api_key: ApiKey | None, messages: list[dict], task: str | None, model: str | None,
              max_tokens: int | None, tier: str | None, deadline_s: float | None, request_id: str | None) -> "_Plan":
        """Who may call which models, within which deadline, reserving how many tokens."""
        requested = self._resolve(task, model, tier)
        if self.keys is not None and api_key is None:
            raise self._unauthenticated("missing")
        if api_key is not None and not api_key.allows_model(requested):
            self.recorder.refusal(api_key.name, "model_not_allowed")
            raise GatewayRefusal(403, "model_not_allowed", f"key {api_key.name} may not use model {requested} "
                                 f"(its models: {', '.join(api_key.models or ())})")
        settings = self.table.gateway
        budget_s = deadline_s if deadline_s is not None else (
            self.table.deadline_s(task) if task else settings.deadline_s)
        chain = tuple(m for m in self.table.fallback_chain(task, requested)
                      if api_key is None or api_key.allows_model(m))
        return _Plan(requested, KeyLimits.of(api_key), chain, time.monotonic() + budget_s, budget_s,
                     request_id or uuid.uuid4().hex, estimate_prompt_tokens(messages, settings.image_tokens_estimate),
                     max_tokens or settings.default_max_tokens)

    def _reserved(self, plan: "_Plan", model: str) -> int:
        price = self.table.prices[model]
        return call_cost_nusd(price.input_per_million, price.output_per_million, plan.prompt_tokens, plan.max_tokens)

    # ----------------------------------------------------------------------------- streaming
    def stream(self, api_key: ApiKey | None, *, messages: list[dict], task: str | None = None,
               model: str | None = None, max_tokens: int | None = None, temperature: float | None = None,
               tier: str | None = None, deadline_s: float | None = None,
               request_id: str | None = None) -> Iterator[dict]:
        """``astream`` from a thread: a blocking iterator of the same chunks. Refusals and failures
        before the first chunk raise from the first ``next()``. Closing it early (``close()``, a
        client that went away) stops the upstream stream and settles the call."""
        loop = self._own_loop()
        chunks = self.astream(api_key, messages=messages, task=task, model=model, max_tokens=max_tokens,
                              temperature=temperature, tier=tier, deadline_s=deadline_s, request_id=request_id)
        try:
            while True:
                try:
                    yield asyncio.run_coroutine_threadsafe(chunks.__anext__(), loop).result()
                except StopAsyncIteration:
                    return
        finally:
            asyncio.run_coroutine_threadsafe(chunks.aclose(), loop).result(timeout=30)

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
            row = await self._admit(plan.limits, api_key, plan.request_id, task, current, plan.prompt_tokens,
                                    plan.max_tokens, remaining, first=not admitted_once, attempts=attempts)
            admitted_once = True
            routed = RoutedRequest(task or "", "gateway", "realtime", current, current, messages=messages,
                                   temperature=temperature, max_tokens=plan.max_tokens)
            started = time.monotonic()
            was_open = self.client.breaker(current).state == "open"
            try:
                call = await self.client.open_stream(routed, remaining)
            except RouteError as error:
                chain = await self._fall_back(error, row, current, chain, attempts, started, was_open, task, api_key)
                last_error = error
                continue
            except BaseException:  # closed or cancelled before the first chunk (the client left): the
                # request went out, the figure is unknown: its reservation, now rather than when abandoned
                await self._settle(row, "failed", cost_nusd=self._reserved(plan, current),
                                   latency_s=time.monotonic() - started, outcome="stream_interrupted")
                raise
            relay = self._relay(call, row, plan, current, attempts, started, api_key)
            try:
                async for item in relay:
                    yield item
            finally:  # closed now, not by the garbage collector: the settlement runs before we return
                await relay.aclose()
            return
        raise self._exhausted(attempts, last_error, plan.budget_s)

    async def _relay(self, call, row, plan: "_Plan", current: str, attempts: list[Attempt], started: float,
                     api_key: ApiKey | None) -> AsyncIterator[dict]:
        requested = plan.requested
        fallback_from = requested if current != requested else None
        reason = fallback_label(attempts[0]) if attempts and fallback_from else None
        settled = False
        chunks = call.__aiter__()
        gateway = {"model": current, "requested_model": requested, "fallback_from": fallback_from,
                   "fallback_reason": reason, "request_id": plan.request_id}
        try:
            last: dict = {}
            first = True
            async for chunk in chunks:
                last = chunk
                chunk.pop("usage", None)
                if chunk.get("choices"):
                    if first:
                        chunk["x_gateway"], first = dict(gateway), False
                    yield chunk
            if call.usage is None:
                input_tokens = output_tokens = None
                charged = self._reserved(plan, current)
            else:
                input_tokens, output_tokens = call.usage
                price = self.table.prices[current]
                charged = call_cost_nusd(price.input_per_million, price.output_per_million, input_tokens,
                                         output_tokens)
            await self._settle(row, "success", input_tokens=input_tokens, output_tokens=output_tokens,
                               cost_nusd=charged, latency_s=time.monotonic() - started,
                               outcome="success" if call.usage else "success_without_usage",
                               fallback_from=fallback_from, fallback_reason=reason)
            settled = True
            if fallback_from:
                self.recorder.fallback(requested, current, reason or "unknown")
            self.recorder.spend(plan.limits.name, current, float(usd(charged)))
            await self._refresh_budget(api_key)
            yield {"id": last.get("id", f"chatcmpl-{plan.request_id}"), "object": "chat.completion.chunk",
                   "created": last.get("created", int(time.time())), "model": current, "choices": [],
                   "usage": {"prompt_tokens": input_tokens, "completion_tokens": output_tokens,
                             "total_tokens": None if call.usage is None else input_tokens + output_tokens,
                             "cost_usd": float(usd(charged))},
                   "x_gateway": gateway}
        finally:
            await chunks.aclose()  # the upstream stream closes now
            if not settled:  # broken mid-way or abandoned by its client: tokens went out, figure unknown
                await self._settle(row, "failed", cost_nusd=self._reserved(plan, current),
                                   latency_s=time.monotonic() - started, outcome="stream_interrupted",
                                   fallback_from=fallback_from, fallback_reason=reason)

    async def _admit(self, limits: KeyLimits, api_key: ApiKey | None, request_id: str, task: str | None,
                     model: str, prompt_tokens: int, max_tokens: int, remaining_s: float, first: bool,
                     attempts: list[Attempt]) -> int | None:
        if self.ledger is None:
            return None
        price = self.table.prices[model]
        reserved = call_cost_nusd(price.input_per_million, price.output_per_million, prompt_tokens, max_tokens)
        try:
            return await asyncio.to_thread(
                self.ledger.admit, limits, request_id=request_id, task=task or "", model=model,
                reserved_nusd=reserved, reserved_tokens=prompt_tokens + max_tokens,
                expires_in_s=remaining_s + self.table.gateway.reservation_margin_s,
                counts_request=first, check_rates=first)
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

    async def _settle(self, row: int | None, status: str, **figures: Any) -> None:
        if row is None or self.ledger is None:
            return
        try:
            await asyncio.to_thread(self.ledger.settle, row, status=status, **figures)
        except Exception as error:  # the reservation stays and is abandoned at its reserved cost
            self.log(f"gateway: could not settle spend ledger row {row} ({type(error).__name__}: {error}); "
                     f"its reservation stands")
