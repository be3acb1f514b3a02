"""A routed request's payload: the JSON object (strict: no lone surrogates, bounded nesting), its
numeric fields, base64 fields and a gateway task's chat messages."""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Mapping

from triton_pipelines.errors import InputError, check_encodable

MESSAGE_ROLES = ("system", "user", "assistant", "developer", "tool")
# What a vision_llm image may claim to be (it becomes a data: URL sent upstream).
IMAGE_MIME_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
# A JSON escape of a UTF-16 surrogate: only then can a parsed string hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def number_field(payload: Mapping, key: str, kind, low, high):
    value = payload.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise InputError(f"payload field '{key}' must be {'an integer' if kind is int else 'a number'}, "
                         f"not {type(value).__name__}")
    if not low <= value <= high:
        raise InputError(f"payload field '{key}' must be between {low} and {high}, got {value}")
    return kind(value)


def gateway_messages(payload: Mapping) -> list[dict]:
    """``{"messages": [...]}`` (OpenAI chat format) or ``{"text": "..."}`` (one user message;
    with ``image`` base64 for vision, an image part is added)."""
    if "messages" in payload:
        messages = payload["messages"]
        if not isinstance(messages, list) or not messages:
            raise InputError("payload field 'messages' must be a non-empty list of {role, content}")
        for index, message in enumerate(messages):
            if (not isinstance(message, dict) or message.get("role") not in MESSAGE_ROLES
                    or not isinstance(message.get("content"), (str, list))):
                raise InputError(f"payload 'messages'[{index}] must be an object with 'role' "
                                 f"({'|'.join(MESSAGE_ROLES)}) and 'content' (a string or a list of parts)")
        return messages
    if "text" in payload:
        text = payload["text"]
        if not isinstance(text, str) or not text:
            raise InputError("payload field 'text' must be a non-empty string")
        if "image" in payload:
            image = payload["image"]
            if not isinstance(image, str):
                raise InputError("payload field 'image' must be a base64 string")
            decode_base64(image, "image")
            mime = payload.get("image_mime", "image/png")
            if mime not in IMAGE_MIME_TYPES:
                raise InputError(f"payload field 'image_mime' must be one of {', '.join(IMAGE_MIME_TYPES)}, "
                                 f"not {str(mime)[:40]!r}")
            return [{"role": "user", "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{image}"}}]}]
        return [{"role": "user", "content": text}]
    raise InputError("a gateway task's payload needs 'messages' (a list) or 'text' (a string)")


def parse_payload(raw: bytes) -> dict:
    """The payload's JSON object, or InputError: not JSON, nested too deeply for Python's parser
    (RecursionError), or holding a lone UTF-16 surrogate (``"\\ud800"``: not Unicode text)."""
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"payload is not valid JSON: {error}") from None
    except RecursionError:
        raise InputError("payload is nested too deeply to parse") from None
    if not isinstance(payload, dict):
        raise InputError(f"payload must be a JSON object, not {type(payload).__name__}")
    if _SURROGATE_ESCAPE.search(raw):
        check_encodable(payload, "payload")
    return payload


def decode_base64(value: str, name: str) -> bytes:
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"payload field '{name}' is not valid base64") from None
    if not data:
        raise InputError(f"payload field '{name}' is empty")
    return data
