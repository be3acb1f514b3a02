"""The error vocabulary, one home for every layer: bad input (``InputError``), failed calls
(``UpstreamError``, ``RouteError`` with its ``reason``), how each reason is answered
(``error_kind``), the refusal marker and its statuses, and the UTF-8 check every text input goes
through. Each transport maps it once: the stub (``stub.responses``), the screen, ``/v1``, nginx."""

from __future__ import annotations

import math
import re
from typing import Any

# Every bad-input answer of our models starts with this. A direct client also gets the code
# (HTTP 400 / INVALID_ARGUMENT), but a BLS caller (the router) gets only the message (Triton 2.51
# passes a callee's error to a BLS caller as INTERNAL): the prefix is how it tells bad input apart.
INPUT_ERROR_PREFIX = "invalid input: "


class InputError(ValueError):
    """The request's input is invalid; the message names the input and the problem."""


class ConfigError(ValueError):
    """A configuration file, flag or environment variable that breaks a rule. The message names the
    file (or variable), the entry and the rule, in one line: the CLI prints it without a traceback and
    exits 2 (``__main__``)."""


class UpstreamError(RuntimeError):
    """A model called through BLS answered with an error; the message names the model."""


class RequestCancelled(Exception):
    """The request's client has gone (cancelled, or past its deadline): its work stopped. Answered
    with Triton's CANCELLED code (``stub.responses``), though no client reads it."""


def as_bytes(item: Any) -> bytes:
    """One element of a BYTES tensor as bytes (numpy may hand out ``str`` or other objects)."""
    return item if isinstance(item, bytes) else str(item).encode()


def decode_utf8(item: Any, where: str) -> str:
    """One element of a BYTES tensor → ``str``, or InputError naming ``where`` (e.g. ``input
    'text'[1]``) and the first byte that is not UTF-8."""
    data = as_bytes(item)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{where} is not valid UTF-8 (byte 0x{data[error.start]:02x} at offset {error.start})") from None


def check_encodable(value: Any, where: str) -> None:
    """Every string of a JSON value (keys too) encodes as UTF-8, or InputError naming where: JSON may
    carry a lone surrogate (``"\\ud800"``) that no model or upstream can be sent. A client's own
    error, found before any model is tried. Iterative, so depth costs no recursion."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise InputError(f"{path} holds a lone UTF-16 surrogate ({item[error.start]!a} at "
                                 f"index {error.start}): not valid Unicode text") from None
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, f"{path} key"))
                stack.append((child, f"{path}.{key}" if isinstance(key, str) and key.isidentifier() else path))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))


# ------------------------------------------------------------------------------ failure reasons
class RouteError(Exception):
    """A request that could not be served; ``reason`` is the metric label (``failures_total``).
    ``retry_after_s``: what an upstream asked us to wait before trying again, if it said."""

    def __init__(self, reason: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


# Failure reasons that mean "not now" (HTTP 503 / UNAVAILABLE) rather than "bad request" (400) or
# "our fault" (500).
UNAVAILABLE_REASONS = frozenset({"not_loaded", "not_configured", "circuit_open", "timeout", "unreachable",
                                 "upstream_status", "overloaded", "upstream_unavailable", "ledger_unavailable",
                                 "over_budget", "rate_limited"})
INPUT_REASONS = frozenset({"invalid_input", "upstream_invalid_input", "context_window", "unauthenticated",
                           "model_not_allowed"})
# Refused by the key (401/403) or its limits (429): the message carries errors.refusal_text's
# marker, which the request screen turns into that HTTP status / gRPC code.
REFUSAL_REASONS = frozenset({"unauthenticated", "model_not_allowed", "over_budget", "rate_limited"})


def error_kind(reason: str) -> str:
    """``invalid_input`` | ``unavailable`` | ``internal``: how a failure reason is answered."""
    if reason in INPUT_REASONS:
        return "invalid_input"
    return "unavailable" if reason in UNAVAILABLE_REASONS else "internal"


# ------------------------------------------------------------------------------ gateway refusals
# Triton 2.51's error codes have no 401, 403 or 429. The router answers a refusal by a key's
# limits with a message that starts with this marker (HTTP status, and seconds until the limit's
# window reopens); the request screen (screen_server.py) strips it and answers that status with
# `Retry-After` (gRPC: UNAUTHENTICATED / PERMISSION_DENIED / RESOURCE_EXHAUSTED). Without the
# screen in front (Triton's loopback ports), the marker stays in the message.
REFUSAL_STATUSES = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 429: "RESOURCE_EXHAUSTED"}
_REFUSAL = re.compile(r"^\[refused (401|403|429)(?: retry-after=([0-9]{1,9}))?\] ")


def refusal_text(status: int, message: str, retry_after_s: float | None = None) -> str:
    if status not in REFUSAL_STATUSES:
        raise ValueError(f"a refusal's status is one of {sorted(REFUSAL_STATUSES)}, not {status}")
    after = f" retry-after={max(1, math.ceil(retry_after_s))}" if retry_after_s is not None else ""
    return f"[refused {status}{after}] {message}"


# /v1 routing errors, as the frontend (aiohttp's 404/405) and nginx (paths and methods it stops
# before the frontend) answer them: (message, OpenAI code); ``{method}``: the request's method.
OPENAI_NOT_FOUND = ("not found: no such /v1 endpoint", "not_found")
OPENAI_METHOD_NOT_ALLOWED = ("method {method} is not allowed here", "method_not_allowed")


def openai_error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error shape, built here only: the /v1 frontend's errors and nginx's /v1 refusals."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def parse_refusal(text: str) -> tuple[int, int | None, str] | None:
    """(status, Retry-After seconds or None, message without the marker), or None."""
    found = _REFUSAL.match(text)
    if found is None:
        return None
    return int(found.group(1)), int(found.group(2)) if found.group(2) else None, text[found.end():]
