"""What the FastAPI peers share: the app factory with the batcher's lifecycle, body decoding and the
process's own statistics (batches, RSS)."""

from __future__ import annotations

import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request

from ..loadgen import split_bytes_tensor
from .batcher import MicroBatcher

# ONNX Runtime's intra-op threads in every peer: the embedded compute models' setting
# (ComputeModel.embedded_cpu_threads) and the in-process limit's.
THREADS = int(os.environ.get("PEER_THREADS", "2"))


def make_app(title: str, batchers: list[MicroBatcher]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        for batcher in batchers:
            await batcher.start()
        yield
        for batcher in batchers:
            await batcher.stop()

    app = FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/stats")
    async def stats():
        import psutil

        rss = psutil.Process().memory_info().rss
        return {"rss_bytes": rss, "batches": [b.batches for b in batchers], "items": [b.items for b in batchers]}

    return app


async def body_items(request: Request, limit: int = 64) -> list[bytes]:
    """The body: a BYTES tensor's serialization (4-byte little-endian length + bytes per item)."""
    try:
        items = split_bytes_tensor(await request.body())
    except ValueError as error:
        raise HTTPException(400, f"malformed body: {error}") from None
    if not items or len(items) > limit:
        raise HTTPException(400, f"send 1 to {limit} items")
    return items
