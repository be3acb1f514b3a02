"""The external route: an OpenAI-compatible gateway through the official ``openai`` client.

- ``LLM_GATEWAY_BASE_URL`` and ``LLM_GATEWAY_API_KEY`` come from the environment, read when the
  router loads. Without both, every gateway task answers "not configured". The key is handed to
  the client and nothing else: it is never logged, never put in a result or an error message
  (``redact`` removes it from any upstream text we pass on).
- Each attempt has a time-out (``timeout_s``); 429, 5xx, time-outs and connection errors are
  retried at most ``max_retries`` times with exponential backoff; other 4xx are not retried.
- A circuit breaker opens after ``circuit_failure_threshold`` consecutive failed calls and fails
  fast for ``circuit_reset_s``; then one trial call decides (half-open).
- Cost comes from the usage the gateway reports: no usage, no answer (an unaccountable call is an
  error rather than a free one).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from .routing import GatewaySettings, RouteError, RoutedRequest

BASE_URL_ENV = "LLM_GATEWAY_BASE_URL"
API_KEY_ENV = "LLM_GATEWAY_API_KEY"


@dataclass
class Completion:
    text: str
    input_tokens: int
    output_tokens: int
    attempts: int
    latency_s: float


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


def redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


class GatewayClient:
    def __init__(self, settings: GatewaySettings, environ: Mapping[str, str] | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic):
        environ = os.environ if environ is None else environ
        self.settings = settings
        self.base_url = environ.get(BASE_URL_ENV, "").strip()
        self._api_key = environ.get(API_KEY_ENV, "").strip()
        self.sleep = sleep
        self.breaker = CircuitBreaker(settings.circuit_failure_threshold, settings.circuit_reset_s, clock)
        self._client = None
        self._client_lock = threading.Lock()

    def __repr__(self) -> str:  # never show the key
        return f"GatewayClient(base_url={self.base_url!r}, configured={self.configured})"

    @property
    def configured(self) -> bool:
        return bool(self.base_url and self._api_key)

    def _openai(self):
        with self._client_lock:
            if self._client is None:
                from openai import OpenAI

                # Our own retries and breaker: the client's built-in retries are off.
                self._client = OpenAI(base_url=self.base_url, api_key=self._api_key,
                                      timeout=self.settings.timeout_s, max_retries=0)
            return self._client

    def complete(self, routed: RoutedRequest) -> Completion:
        """One chat completion with retries; raises RouteError (reason: not_configured,
        circuit_open, timeout, unreachable, upstream_status, rejected, bad_response)."""
        if not self.configured:
            raise RouteError("not_configured",
                             f"the external gateway is not configured: set {BASE_URL_ENV} and {API_KEY_ENV} "
                             f"in the server's environment to serve task {routed.task}")
        if not self.breaker.allow():
            raise RouteError("circuit_open", f"the external gateway is failing: circuit open, calls fail fast "
                                             f"for another {self.breaker.retry_in_s():.1f} s")
        started = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            try:
                text, input_tokens, output_tokens = self._call(routed)
            except RouteError as error:
                retryable = error.reason in ("timeout", "unreachable", "upstream_status")
                if retryable and attempts <= self.settings.max_retries:
                    self.sleep(min(self.settings.backoff_s * 2 ** (attempts - 1), self.settings.max_backoff_s))
                    continue
                if error.reason == "rejected":
                    self.breaker.record_success()  # the gateway is up; the request was refused
                else:
                    self.breaker.record_failure()
                suffix = f" (after {attempts} attempts)" if attempts > 1 else ""
                raise RouteError(error.reason, f"{error}{suffix}") from None
            self.breaker.record_success()
            return Completion(text, input_tokens, output_tokens, attempts, time.monotonic() - started)

    def _call(self, routed: RoutedRequest) -> tuple[str, int, int]:
        import openai

        arguments = {"model": routed.target, "messages": routed.messages, "max_tokens": routed.max_tokens}
        if routed.temperature is not None:
            arguments["temperature"] = routed.temperature
        try:
            response = self._openai().chat.completions.create(**arguments)
        except openai.APITimeoutError:
            raise RouteError("timeout", f"the gateway did not answer within {self.settings.timeout_s:g} s") from None
        except openai.APIConnectionError:
            raise RouteError("unreachable", "the gateway is unreachable (connection failed)") from None
        except openai.APIStatusError as error:
            status = error.status_code
            detail = redact(str(getattr(error, "message", "") or "")[:300], self._api_key)
            if status == 429 or status >= 500:
                raise RouteError("upstream_status", f"the gateway answered HTTP {status}: {detail}") from None
            raise RouteError("rejected", f"the gateway refused the request: HTTP {status}: {detail}") from None
        except openai.APIResponseValidationError:
            raise RouteError("bad_response", "the gateway's answer is not a chat completion") from None
        except (ValueError, TypeError) as error:  # e.g. a body that is not JSON
            raise RouteError("bad_response", f"the gateway's answer could not be read "
                                             f"({type(error).__name__})") from None
        return parse_completion(response)


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
