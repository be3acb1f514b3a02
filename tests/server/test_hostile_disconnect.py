"""Clients that leave mid-request (issue 33 §1), through the public port of the real server with
the loopback fake gateway: hanging up (FIN) or resetting (RST) while the body is sent, while a
chat call or its admission runs, mid-stream (twenty times between two writes of a fast stream: the
next write fails before aiohttp cancels the handler, which aiohttp logged as a failed request with
a traceback); none leaves a traceback in the log and a neighbour's chat is answered. The server of ``test_gateway_chat.py`` (router-only, its keys and ledger)."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from tests.server.test_gateway_chat import HI, SECRETS, client, gateway, server, setup  # noqa: F401 - fixtures
from tests.support.fake_gateway import Reply

openai = pytest.importorskip("openai")


def request(path: str, body: bytes, content_length: int | None = None) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if content_length is None else content_length}\r\n"
            f"Authorization: Bearer {SECRETS['open']}\r\n\r\n").encode() + body


def leave(address: str, raw: bytes, after_s: float, reset: bool, read_first: int = 0) -> None:
    host, port = address.rsplit(":", 1)
    connection = socket.create_connection((host, int(port)), timeout=10)
    connection.sendall(raw)
    if read_first:
        connection.recv(read_first)
    time.sleep(after_s)
    if reset:  # RST instead of FIN
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
def test_clients_that_leave_mid_request_leave_no_traceback(server, gateway, setup, reset):  # noqa: F811
    log = setup[3]
    before = len(log.read_bytes())
    gateway.default = Reply(delay_s=0.8, chunk_delay_s=0.2)
    chat = json.dumps({"model": "deepseek-v3.2", "messages": HI}).encode()
    streamed = json.dumps({"model": "deepseek-v3.2", "messages": HI, "stream": True}).encode()
    address = server.http_url
    leave(address, request("/v1/chat/completions", chat[:10], len(chat)), 0.3, reset)  # mid-body
    leave(address, request("/v1/chat/completions", chat), 0.2, reset)  # while the call runs
    leave(address, request("/v1/chat/completions", streamed), 0.0, reset)  # during admission
    leave(address, request("/v1/chat/completions", streamed), 0.2, reset)  # before the first chunk
    leave(address, request("/v1/chat/completions", streamed), 0.3, reset, read_first=1)  # mid-stream
    leave(address, request("/v1/embeddings", b'{"model": "text_embedding", "input": "x"'), 0.1, reset)
    gateway.default = Reply(chunk_delay_s=0.001, content="x " * 400)  # a write every millisecond
    for _ in range(20):  # the client leaves between two writes: the next one fails (a race)
        leave(address, request("/v1/chat/completions", streamed), 0.01, reset, read_first=1)
    time.sleep(3.0)  # the calls finish and settle
    gateway.default = Reply()
    answer = client(server, "open").chat.completions.create(model="deepseek-v3.2", messages=HI)
    assert answer.choices[0].message.content
    logged = log.read_bytes()[before:].decode(errors="replace")
    assert "Traceback" not in logged and "Error handling request" not in logged, logged[-3000:]
