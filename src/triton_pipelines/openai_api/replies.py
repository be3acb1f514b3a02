"""What every ``/v1`` handler answers with (aiohttp responses of a JSON or text body, an OpenAI error)
and how it reads a JSON body (bounded)."""

from __future__ import annotations

import json

from triton_pipelines.openai_api import protocol as proto


def reply(body, status: int = 200, content_type: str = "application/json", headers=None):
    from aiohttp import web

    text = body if isinstance(body, str) else json.dumps(body)
    return web.Response(text=text, status=status, headers=headers,
                        content_type=content_type.split(";")[0], charset="utf-8")


def error_reply(error: proto.OpenAIError):
    return reply(error.body(), error.status, headers=dict(error.headers))


async def json_body(request, limit: int = proto.MAX_JSON_BODY_BYTES) -> dict:
    """The endpoint's JSON body: at most ``limit`` bytes (413 before it is read, by its length) and
    ``proto.MAX_JSON_STRUCTURE`` values (400 before it is parsed: ``proto.parse_json_body``)."""
    if request.content_length is not None and request.content_length > limit:
        raise proto.too_large(f"the request body is {request.content_length} bytes; the limit for JSON bodies "
                              f"of {request.path} is {limit} bytes")
    if "json" not in (request.content_type or ""):
        raise proto.invalid(f"the body must be JSON (Content-Type: application/json), not "
                            f"{(request.content_type or 'none')[:64]!r}")
    return proto.parse_json_body(await request.read(), limit)
