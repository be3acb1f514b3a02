"""The W3C trace context (``traceparent``, ``tracestate``) as a client sends it: checked before
anything reads it, standard library only. A value that is not well formed, or that is longer than
the bounds here, is dropped (a trace is then started afresh); it is never passed on as it came:
what goes on to Triton is written from the span that the front started (``format_traceparent``).

https://www.w3.org/TR/trace-context/"""

from __future__ import annotations

import re
from dataclasses import dataclass

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# The response header (HTTP) and trailing metadata (gRPC) that names a request's trace.
TRACE_ID_HEADER = "x-trace-id"
# W3C: a version-00 traceparent is 55 characters; a later version may append fields, which we
# read past but bound. tracestate: at most 32 list members, and 512 characters is what the
# specification asks every vendor to propagate.
MAX_TRACEPARENT_CHARS = 128
MAX_TRACESTATE_CHARS = 512
MAX_TRACESTATE_MEMBERS = 32
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[0-9a-zA-Z._-]*)?")
_MEMBER = re.compile(r"([a-z0-9][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
                     r"=([\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e])")


@dataclass(frozen=True)
class TraceParent:
    trace_id: str  # 32 lowercase hex digits, not all zero
    span_id: str  # 16 lowercase hex digits, not all zero
    sampled: bool

    def header(self) -> str:
        return format_traceparent(self.trace_id, self.span_id, self.sampled)


def parse_traceparent(value) -> TraceParent | None:
    """A client's ``traceparent`` → its parts; None for anything else (absent, too long, not text,
    malformed, version ff, an all-zero id, or version 00 with anything after the flags)."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or len(value) > MAX_TRACEPARENT_CHARS:
        return None
    found = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if found is None:
        return None
    version, trace_id, span_id, flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceParent(trace_id, span_id, bool(int(flags, 16) & 1))


def clean_tracestate(value) -> str | None:
    """A client's ``tracestate``, when well formed and within the bounds; else None (dropped)."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_TRACESTATE_CHARS:
        return None
    members = [m.strip(" \t") for m in value.split(",") if m.strip(" \t")]
    if len(members) > MAX_TRACESTATE_MEMBERS or not all(_MEMBER.fullmatch(m) for m in members):
        return None
    keys = [m.split("=", 1)[0] for m in members]
    if len(set(keys)) != len(keys):
        return None
    return ",".join(members)


def format_traceparent(trace_id: str, span_id: str, sampled: bool) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"
