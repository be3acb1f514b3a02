"""The W3C trace context a client sends: what is honoured, what is dropped (never passed on)."""

from __future__ import annotations

import pytest

from triton_pipelines.telemetry.context import (MAX_TRACEPARENT_CHARS, MAX_TRACESTATE_CHARS, MAX_TRACESTATE_MEMBERS,
                                                clean_tracestate, format_traceparent, parse_traceparent)

GOOD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_well_formed_traceparent_is_read_back_as_written():
    parent = parse_traceparent(GOOD)
    assert (parent.trace_id, parent.span_id, parent.sampled) == ("0af7651916cd43dd8448eb211c80319c",
                                                                 "b7ad6b7169203331", True)
    assert parent.header() == GOOD
    assert parse_traceparent(GOOD.encode()) == parent
    assert not parse_traceparent(GOOD[:-2] + "00").sampled
    assert format_traceparent(parent.trace_id, "00f067aa0ba902b7", False) == \
        "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-00"


def test_a_later_version_with_more_fields_is_read_within_its_bound():
    assert parse_traceparent("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra").sampled


@pytest.mark.parametrize("value", [
    None, "", "garbage", GOOD.upper(), GOOD + "-extra",  # version 00 has nothing after the flags
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
    "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",  # a short trace id
    "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-" + "x" * MAX_TRACEPARENT_CHARS,  # huge
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nx-injected: 1",
    b"\xff\xfe", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333\u0661-01", 12,
])
def test_a_malformed_or_huge_traceparent_is_dropped(value):
    assert parse_traceparent(value) is None


def test_tracestate_is_kept_when_well_formed_and_dropped_otherwise():
    assert clean_tracestate("congo=t61rcWkgMzE, rojo=00f067aa0ba902b7") == "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    assert clean_tracestate("tenant@vendor=value") == "tenant@vendor=value"
    for bad in ("", "no-equals", "a=1,a=2", "Upper=1", "a=1\r\nx: y", "a=" + "v" * MAX_TRACESTATE_CHARS,
                ",".join(f"k{i}=v" for i in range(MAX_TRACESTATE_MEMBERS + 1)), b"\xff=1", None):
        assert clean_tracestate(bad) is None, bad
