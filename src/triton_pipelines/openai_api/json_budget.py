"""How much work a /v1 JSON body asks of ``json.loads``, counted before it runs (issue 33 §2: 16 MiB of
``[[]],`` held the event loop 4.4 s). Standard library only; ``protocol.parse_json_body`` refuses a
body over the budget."""

from __future__ import annotations

# JSON structure in one body (``json_structure``: about the values json.loads would build). It
# builds a Python object per value on the event loop: 16 MiB of `[[]],` (6.7 million lists) held
# every /v1 endpoint 4.4 s (issue 33 §2). 2048 embedding inputs, or a chat of 256 messages with
# tools, is a few thousand.
MAX_JSON_STRUCTURE = 100_000


def json_structure(raw: bytes) -> int:
    """About the number of values ``json.loads(raw)`` builds (at most twice it), counted at C speed
    before it runs: its commas, brackets and braces (every value of a container but the first follows
    a comma). Where those are more than ``MAX_JSON_STRUCTURE`` they may be text (a string may hold
    any number of commas): then the strings, and the commas, brackets and braces outside them."""
    quick = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
    if quick <= MAX_JSON_STRUCTURE:
        return quick
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw  # escapes: not quotes
    strings = text.count(b'"') // 2
    if strings > MAX_JSON_STRUCTURE:
        return strings
    outside = b"".join(text.split(b'"')[0::2])
    return strings + outside.count(b",") + outside.count(b"[") + outside.count(b"{") + 1
