"""The external route: an OpenAI-compatible gateway through the official ``openai`` client (async).

- ``LLM_GATEWAY_BASE_URL`` and ``LLM_GATEWAY_API_KEY`` come from the environment, read when the
  router loads. Without both, every gateway task answers "not configured". The key is handed to
  the client and nothing else: it is never logged, never put in a result or an error message
  (``redact`` removes it from any upstream text we pass on).
- Every routed request has ONE total deadline (``deadline_s`` of its task, else the gateway's):
  attempts, backoff and a server's ``Retry-After`` all fit inside it; an attempt gets at most
  ``timeout_s`` and never more than what is left. 429, 5xx, time-outs and connection errors are
  retried at most ``max_retries`` times; other 4xx are not retried.
- One circuit breaker per upstream model (the router runs one instance, so it is the breaker of the
  whole server): it opens after ``circuit_failure_threshold`` consecutive failed calls of that
  model and fails fast for ``circuit_reset_s``; then one trial call decides (half-open). A model
  that fails does not close the road to the others.
- Cost comes from the usage the gateway reports: no usage, no answer (an unaccountable call is an
  error rather than a free one).
"""

from __future__ import annotations

import asyncio
import email.utils
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

from triton_pipelines.errors import RouteError
from triton_pipelines.repository.routes import GatewaySettings, RoutedRequest

BASE_URL_ENV = "LLM_GATEWAY_BASE_URL"
API_KEY_ENV = "LLM_GATEWAY_API_KEY"
# An attempt needs at least this long to be worth starting.
MIN_ATTEMPT_S = 0.05
RETRYABLE = ("timeout", "unreachable", "upstream_status")
# How providers say a prompt is longer than the model's window (OpenAI's code, and the texts of
# others behind OpenAI-compatible gateways).
CONTEXT_WINDOW_CODES = ("context_length_exceeded", "context_window_exceeded", "string_above_max_length")
CONTEXT_WINDOW_TEXT = re.compile(r"context[ _-]?(length|window)|maximum context|too many tokens|prompt is too long",
                                 re.IGNORECASE)


@dataclass
class Completion:
    text: str
    input_tokens: int
    output_tokens: int
    attempts: int


class CircuitBreaker:
    """closed → (threshold consecutive failures) → open → (reset_s) → half-open → one trial call."""

    def __init__(self, failure_threshold: int, reset_s: float, clock: Callable[[], float] = time.monotonic):
        self.failure_threshold = failure_threshold
        self.reset_s = reset_s
        self.clock = clock
        self.failures = 0
        self.opened_at: float | None = None
        self.trial_in_flight = False
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "open" if self.clock() - self.opened_at < self.reset_s else "half_open"

    def allow(self) -> bool:
        with self._lock:
            state = self._state()
            if state == "closed":
                return True
            if state == "half_open" and not self.trial_in_flight:
                self.trial_in_flight = True
                return True
            return False

    def retry_in_s(self) -> float:
        with self._lock:
            return 0.0 if self.opened_at is None else max(0.0, self.reset_s - (self.clock() - self.opened_at))

    def record_success(self) -> None:
        with self._lock:
            self.failures, self.opened_at, self.trial_in_flight = 0, None, False

    def record_failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self.trial_in_flight or self.failures >= self.failure_threshold:
                self.opened_at = self.clock()
            self.trial_in_flight = False

    def release_trial(self) -> None:
        """A half-open trial that ended without a verdict (cancelled): let the next call try."""
        with self._lock:
            self.trial_in_flight = False


def redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def retry_after_s(headers) -> float | None:
    """Seconds from ``Retry-After`` (seconds or an HTTP date) or ``retry-after-ms``; None if absent."""
    if headers is None:
        return None
    try:
        if headers.get("retry-after-ms"):
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
        value = headers.get("retry-after")
        if not value:
            return None
        try:
            return max(0.0, float(value))
        except ValueError:
            when = email.utils.parsedate_to_datetime(value)
            return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


class GatewayClient:
    def __init__(self, settings: GatewaySettings, environ: Mapping[str, str] | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic):
        environ = os.environ if environ is None else environ
        self.settings = settings
        self.base_url = environ.get(BASE_URL_ENV, "").strip()
        self._api_key = environ.get(API_KEY_ENV, "").strip()
        self.sleep = sleep
        self.clock = clock
        self.breakers: dict[str, CircuitBreaker] = {}
        self._client = None

    def __repr__(self) -> str:  # never show the key
        return f"GatewayClient(base_url={self.base_url!r}, configured={self.configured})"

    @property
    def configured(self) -> bool:
        return bool(self.base_url and self._api_key)

    def breaker(self, model: str) -> CircuitBreaker:
        if model not in self.breakers:
            self.breakers[model] = CircuitBreaker(self.settings.circuit_failure_threshold,
                                                  self.settings.circuit_reset_s, self.clock)
        return self.breakers[model]

    def _openai(self):
        if self._client is None:
            from openai import AsyncOpenAI

            # Our own retries, deadline and breaker: the client's built-in retries are off.
            self._client = AsyncOpenAI(base_url=self.base_url, api_key=self._api_key,
                                       timeout=self.settings.timeout_s, max_retries=0)
        return self._client

    async def complete(self, routed: RoutedRequest, deadline_s: float | None = None) -> Completion:
        """One chat completion with retries, all within ``deadline_s``; raises RouteError (reason:
        not_configured, circuit_open, timeout, unreachable, upstream_status, rejected, context_window,
        bad_response)."""
        breaker = self._admit(routed)
        budget = deadline_s if deadline_s is not None else self.settings.deadline_s
        deadline = self.clock() + budget
        attempts = 0
        verdict = False
        try:
            while True:
                attempts += 1
                remaining = deadline - self.clock()
                try:
                    if remaining < MIN_ATTEMPT_S:
                        raise RouteError("timeout", f"no answer within the request's deadline of {budget:g} s")
                    attempt_s = min(self.settings.timeout_s, remaining)
                    text, input_tokens, output_tokens = await self._attempt(routed, attempt_s)
                except RouteError as error:
                    wait = self._backoff(error, attempts)
                    left = deadline - self.clock()
                    if error.reason in RETRYABLE and attempts <= self.settings.max_retries and wait is not None:
                        if wait + MIN_ATTEMPT_S <= left:
                            await self.sleep(wait)
                            continue
                        error = RouteError(error.reason, f"{error}; a retry after {wait:.1f} s would pass the "
                                                         f"request's deadline of {budget:g} s")
                    if error.reason in ("rejected", "context_window"):
                        breaker.record_success()  # the gateway is up; the request was refused
                    else:
                        breaker.record_failure()
                    verdict = True
                    suffix = f" (after {attempts} attempts)" if attempts > 1 else ""
                    final = RouteError(error.reason, f"{error}{suffix}")
                    final.http_status = getattr(error, "http_status", None)
                    raise final from None
                breaker.record_success()
                verdict = True
                return Completion(text, input_tokens, output_tokens, attempts)
        finally:
            if not verdict:  # cancelled (the router's own deadline, a shutdown): no verdict on the gateway
                breaker.release_trial()

    def _admit(self, routed: RoutedRequest) -> CircuitBreaker:
        """The model's breaker, once the gateway is configured and the breaker lets a call through."""
        if not self.configured:
            raise RouteError("not_configured",
                             f"the external gateway is not configured: set {BASE_URL_ENV} and {API_KEY_ENV} "
                             f"in the server's environment to serve task {routed.task}")
        breaker = self.breaker(routed.target)
        if not breaker.allow():
            raise RouteError("circuit_open", f"the external gateway is failing for model {routed.target}: circuit "
                                             f"open, calls fail fast for another {breaker.retry_in_s():.1f} s")
        return breaker

    def _backoff(self, error: RouteError, attempts: int) -> float | None:
        exponential = min(self.settings.backoff_s * 2 ** (attempts - 1), self.settings.max_backoff_s)
        asked = getattr(error, "retry_after_s", None)
        return exponential if asked is None else max(asked, 0.0)

    async def _attempt(self, routed: RoutedRequest, timeout_s: float) -> tuple[str, int, int]:
        try:
            # wait_for as well: the client's timeout covers each network phase, not the whole call.
            return await asyncio.wait_for(self._call(routed, timeout_s), timeout_s + 0.05)
        except asyncio.TimeoutError:
            raise RouteError("timeout", f"the gateway did not answer within {timeout_s:g} s") from None

    async def _call(self, routed: RoutedRequest, timeout_s: float) -> tuple[str, int, int]:
        arguments = {"model": routed.target, "messages": routed.messages, "max_tokens": routed.max_tokens}
        if routed.temperature is not None:
            arguments["temperature"] = routed.temperature
        response = await self._mapped(self._openai().chat.completions.create(**arguments, timeout=timeout_s),
                                      routed.target, timeout_s)
        return parse_completion(response)

    async def open_stream(self, routed: RoutedRequest, deadline_s: float):
        """A streamed chat completion (``stream_options.include_usage``): waits for the first chunk
        (a failure until then is a RouteError, as ``complete``'s, without retries: the caller falls
        back), then returns an async iterator of the chunks as dicts, the first one included. The
        breaker hears the verdict when the stream ends."""
        breaker = self._admit(routed)
        timeout_s = min(self.settings.timeout_s, deadline_s)
        arguments = {"model": routed.target, "messages": routed.messages, "max_tokens": routed.max_tokens,
                     "stream": True, "stream_options": {"include_usage": True}}
        if routed.temperature is not None:
            arguments["temperature"] = routed.temperature

        async def first():
            stream = await self._openai().chat.completions.create(**arguments, timeout=timeout_s)
            iterator = stream.__aiter__()
            return stream, iterator, await iterator.__anext__()

        try:
            stream, iterator, chunk = await self._guard(first(), timeout_s, routed.target)
        except RouteError as error:
            breaker.record_success() if error.reason in ("rejected", "context_window") else breaker.record_failure()
            raise
        except BaseException:
            breaker.release_trial()
            raise
        return StreamCall(self, breaker, stream, iterator, chunk, timeout_s, routed.target)

    async def _guard(self, awaitable, timeout_s: float, model: str):
        """``awaitable`` within ``timeout_s``, the client's exceptions as RouteError (``_mapped``)."""
        try:
            return await asyncio.wait_for(self._mapped(awaitable, model, timeout_s), timeout_s + 0.05)
        except asyncio.TimeoutError:
            raise RouteError("timeout", f"the gateway did not answer within {timeout_s:g} s") from None
        except StopAsyncIteration:
            raise RouteError("bad_response", "the gateway's stream ended before its first chunk") from None

    async def _mapped(self, awaitable, model: str, timeout_s: float):
        """``awaitable`` (a call of the ``openai`` client), its exceptions as RouteError: timeout,
        unreachable, upstream_status (429/5xx: retryable, with ``retry_after_s`` and
        ``http_status``), context_window, rejected (other 4xx), bad_response."""
        import openai

        try:
            return await awaitable
        except openai.APITimeoutError:
            raise RouteError("timeout", f"the gateway did not answer within {timeout_s:g} s") from None
        except openai.APIConnectionError:
            raise RouteError("unreachable", "the gateway is unreachable (connection failed)") from None
        except openai.APIStatusError as error:
            status = error.status_code
            detail = redact(str(getattr(error, "message", "") or "")[:300], self._api_key)
            if status == 429 or status >= 500:
                failure = RouteError("upstream_status", f"the gateway answered HTTP {status}: {detail}")
                failure.http_status = status
                failure.retry_after_s = retry_after_s(getattr(error.response, "headers", None))
                raise failure from None
            if status in (400, 413, 422) and (getattr(error, "code", None) in CONTEXT_WINDOW_CODES
                                              or CONTEXT_WINDOW_TEXT.search(detail)):
                raise RouteError("context_window", f"the prompt does not fit model {model}'s context "
                                                   f"window: HTTP {status}: {detail}") from None
            raise RouteError("rejected", f"the gateway refused the request: HTTP {status}: {detail}") from None
        except (openai.APIResponseValidationError, ValueError, TypeError) as error:
            raise RouteError("bad_response", f"the gateway's answer could not be read "
                                             f"({type(error).__name__})") from None

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()


def parse_completion(response) -> tuple[str, int, int]:
    """(text, input_tokens, output_tokens) from a ChatCompletion, or RouteError(bad_response)."""
    choices = getattr(response, "choices", None)
    usage = getattr(response, "usage", None)
    if not choices or getattr(getattr(choices[0], "message", None), "content", None) is None:
        raise RouteError("bad_response", "the gateway's answer has no choices[0].message.content")
    input_tokens = getattr(usage, "prompt_tokens", None)
    output_tokens = getattr(usage, "completion_tokens", None)
    if not isinstance(input_tokens, int) or not isinstance(output_tokens, int) or input_tokens < 0 or output_tokens < 0:
        raise RouteError("bad_response", "the gateway's answer reports no usable token usage, so its cost is "
                                         "unknown: refused")
    return str(choices[0].message.content), input_tokens, output_tokens


_END = object()


class StreamCall:
    """An open streamed completion: ``async for chunk in call`` (dicts, OpenAI's chunk shape),
    then ``usage`` (prompt_tokens, completion_tokens) if the gateway reported it."""

    def __init__(self, client: GatewayClient, breaker: CircuitBreaker, stream, iterator, first, timeout_s: float,
                 model: str):
        self.client, self.breaker, self.stream, self.iterator = client, breaker, stream, iterator
        self.first, self.timeout_s, self.model = first, timeout_s, model
        self.usage: tuple[int, int] | None = None
        self.text: list[str] = []

    def _note(self, chunk) -> dict:
        data = chunk.model_dump(exclude_none=True) if hasattr(chunk, "model_dump") else dict(chunk)
        usage = data.get("usage")
        if usage and isinstance(usage.get("prompt_tokens"), int) and isinstance(usage.get("completion_tokens"), int):
            self.usage = (usage["prompt_tokens"], usage["completion_tokens"])
        for choice in data.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.text.append(content)
        return data

    async def _next(self):
        try:
            return await self.iterator.__anext__()
        except StopAsyncIteration:
            return _END

    async def __aiter__(self):
        verdict = False
        try:
            yield self._note(self.first)
            while True:
                chunk = await self.client._guard(self._next(), self.timeout_s, self.model)
                if chunk is _END:
                    break
                yield self._note(chunk)
            self.breaker.record_success()
            verdict = True
        except RouteError:
            self.breaker.record_failure()
            verdict = True
            raise
        finally:
            if not verdict:
                self.breaker.release_trial()
            close = getattr(self.stream, "close", None)
            if close is not None:
                try:
                    await close()
                except Exception:
                    pass
