"""HTTP/1.1 over asyncio streams: a keep-alive connection pool to one upstream, a message's head
and body read from a stream.

Shared plumbing of the request screen (``front/screen_server.py``, forwarding to Triton's HTTP
port) and the ``/v1`` frontend (``openai_api/triton_http.py``, Triton's inference over HTTP).
"""

from __future__ import annotations

import asyncio

IDLE_UPSTREAM_CONNECTIONS = 64


class Upstream:
    """Keep-alive HTTP/1.1 connections to one Triton HTTP port."""

    def __init__(self, address: str):
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def connection(self):
        """(reader, writer, reused): a pooled connection if one is open, else a new one."""
        while self.idle:
            reader, writer = self.idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer, True
            writer.close()
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=2**20)
        return reader, writer, False

    def release(self, reader, writer, reusable: bool) -> None:
        if reusable and len(self.idle) < IDLE_UPSTREAM_CONNECTIONS:
            self.idle.append((reader, writer))
        else:
            writer.close()


async def read_head(reader: asyncio.StreamReader) -> tuple[bytes, list[tuple[bytes, bytes]]] | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = raw[:-4].split(b"\r\n")
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    return lines[0], headers


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


async def read_body(reader: asyncio.StreamReader, headers) -> bytes:
    length = header(headers, b"content-length")
    if length is not None:
        return await reader.readexactly(int(length))
    if (header(headers, b"transfer-encoding") or b"").lower() == b"chunked":
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers from Triton
                return b"".join(chunks)
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)
    return b""
