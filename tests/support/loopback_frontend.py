"""A loopback /v1 Frontend (keys on, no Triton) for unit tests: ``with_frontend(work)`` runs
``work(port)`` in a thread against it and returns what ``work`` returns (``request_bytes``: its
byte budget, a ``front.places.Places``)."""

from __future__ import annotations

import asyncio

from triton_pipelines.gateway.keys import KeyRing
from triton_pipelines.openai_api import protocol as proto

CATALOG = proto.ModelCatalog.build(["text_embedding", "speech_recognition"], ["gpt-4.1"])
KEY = "sk-unit-team-a-0123456789"


def with_frontend(work, request_bytes=None):
    from aiohttp import web

    from triton_pipelines.openai_api.app import Frontend

    keys = KeyRing.from_document({"keys": [{"key": KEY, "name": "team-a"}]})

    async def run():
        runner = web.AppRunner(Frontend(None, CATALOG, keys, lambda texts: 0, request_bytes=request_bytes).app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await asyncio.get_running_loop().run_in_executor(None, work, port)
        finally:
            await runner.cleanup()

    return asyncio.run(run())
