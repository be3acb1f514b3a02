"""The screen marks a request on the cancel board when its client leaves before the answer:
HTTP (nginx closes the connection), a gRPC ModelInfer call cancelled, a stream cancelled with
requests in Triton. Every forwarded request carries its own id; a client's own value never
passes. Fake Tritons on loopback, no server."""

from __future__ import annotations

import asyncio

import grpc

from triton_pipelines.cancel_board import CancelBoard
from triton_pipelines.front.places import Places
from triton_pipelines.front.screen import ScreenPolicy
from triton_pipelines.front.screen_server import GRPC_INFER_METHOD, GRPC_STREAM_METHOD, GrpcScreen, HttpScreen
from triton_pipelines.http1 import Upstream
from triton_pipelines.limits import CLIENT_CANCEL_PARAMETER

from tests.unit.front.test_screen_places import FakeTriton, client_metadata, infer_request, serve, wait_for
from tests.unit.front.test_screen_server import FakeTriton as FakeHttpTriton, request

HEADER = CLIENT_CANCEL_PARAMETER.encode()


def header_id(head: bytes) -> str:
    return next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                if line.lower().startswith(HEADER + b":"))


async def http_hang_up(board: CancelBoard) -> tuple[list[bytes], list[str]]:
    """Two requests to a Triton that answers after 1 s: the first client waits, the second hangs up."""
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    triton = FakeHttpTriton([ok], delay_s=1.0), FakeHttpTriton([ok], delay_s=1.0)  # one connection each
    handlers = iter(triton)

    async def slow_triton(reader, writer):
        await next(handlers).handle(reader, writer)

    upstream = await asyncio.start_server(slow_triton, "127.0.0.1", 0)
    screen = HttpScreen(ScreenPolicy(max_body_bytes=2**20, public_models=frozenset({"text_embedding"})),
                        Upstream(f"127.0.0.1:{upstream.sockets[0].getsockname()[1]}"), board=board)
    front = await asyncio.start_server(screen.serve, "127.0.0.1", 0)
    port = front.sockets[0].getsockname()[1]
    stays = await asyncio.open_connection("127.0.0.1", port)
    leaves = await asyncio.open_connection("127.0.0.1", port)
    forged = request(extra=HEADER + b": " + b"0" * 32 + b"\r\n")
    for _, writer in (stays, leaves):
        writer.write(forged)
        await writer.drain()
    await wait_for(lambda: any(t.received for t in triton))
    leaves[1].close()
    head = await asyncio.wait_for(stays[0].readuntil(b"\r\n\r\n"), 10)
    reply = head + await stays[0].readexactly(2)
    stays[1].close()
    front.close()
    upstream.close()
    await wait_for(lambda: all(t.received for t in triton))
    return [reply], [header_id(head) for t in triton for head, _ in t.received]


def test_an_http_client_that_hangs_up_is_marked_and_one_that_waits_is_not(tmp_path):
    board = CancelBoard(tmp_path / "cancel").create()
    (reply,), ids = asyncio.run(http_hang_up(board))
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"{}")
    assert len(ids) == 2 and len(set(ids)) == 2 and "0" * 32 not in ids  # the screen's own ids only
    marked = [request_id for request_id in ids if board.marked(request_id)]
    assert len(marked) == 1, ids


class SlowTriton(FakeTriton):
    async def infer(self, request, context):
        self.metadata.append(tuple(context.invocation_metadata()))
        await asyncio.sleep(2.0)
        return b""


async def grpc_cancels(board: CancelBoard) -> list[tuple]:
    triton = SlowTriton()
    triton_server, address = await serve(triton.handler())
    screen = GrpcScreen(ScreenPolicy(max_body_bytes=2**20), address, places=Places(8), board=board)
    screen_server, screen_address = await serve(screen.handler())
    channel = grpc.aio.insecure_channel(screen_address)
    forged = client_metadata() + ((CLIENT_CANCEL_PARAMETER, "0" * 32),)
    try:
        call = channel.unary_unary(GRPC_INFER_METHOD)(infer_request(), metadata=forged)
        await wait_for(lambda: len(triton.metadata) == 1)
        call.cancel()
        stream = channel.stream_stream(GRPC_STREAM_METHOD)(metadata=forged)
        await stream.write(infer_request(request_id="s"))
        await wait_for(lambda: len(triton.metadata) == 2)
        stream.cancel()
        await wait_for(lambda: len(list(board.folder.iterdir())) == 2)
        return triton.metadata
    finally:
        await channel.close()
        await screen_server.stop(None)
        await triton_server.stop(None)
        await screen.channel.close()


def test_a_cancelled_grpc_call_and_stream_are_marked(tmp_path):
    board = CancelBoard(tmp_path / "cancel").create()
    metadata = asyncio.run(grpc_cancels(board))
    ids = [[v for k, v in m if k == CLIENT_CANCEL_PARAMETER] for m in metadata]
    assert all(len(found) == 1 and found[0] != "0" * 32 for found in ids), ids
    assert all(board.marked(found[0]) for found in ids)
