"""Bad requests and failed calls: the errors adapters turn into per-request error responses, and
the UTF-8 check every text input goes through."""

from __future__ import annotations

from typing import Any

# Every bad-input answer of our models starts with this. A direct client also gets the code
# (HTTP 400 / INVALID_ARGUMENT), but a BLS caller (the router) gets only the message (Triton 2.51
# passes a callee's error to a BLS caller as INTERNAL): the prefix is how it tells bad input apart.
INPUT_ERROR_PREFIX = "invalid input: "


class InputError(ValueError):
    """The request's input is invalid; the message names the input and the problem."""


class UpstreamError(RuntimeError):
    """A model called through BLS answered with an error; the message names the model."""


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
