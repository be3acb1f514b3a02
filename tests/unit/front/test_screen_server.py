"""The request screen's HTTP forwarder (screen_server.HttpScreen) against a fake Triton: what it
forwards, how it frames answers, and what a client gets when Triton fails. No server needed."""

from __future__ import annotations

import asyncio
import json

import pytest

from triton_pipelines.front.screen import ScreenPolicy
from triton_pipelines.front.screen_server import HttpScreen
from triton_pipelines.http1 import Upstream

BODY = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}]}).encode()
STUB_DEAD = b'{"error":"Failed to process the request(s) for model \'text_tokenizer_0_0\', message: Stub process \'text_tokenizer_0_0\' is not healthy."}'


class FakeTriton:
    """Answers each request with the next scripted raw response (after ``delay_s``); records what it
    received."""

    def __init__(self, answers: list[bytes], delay_s: float = 0.0):
        self.answers, self.received, self.connections = list(answers), [], 0
        self.delay_s = delay_s  # before each answer

    async def handle(self, reader, writer):
        self.connections += 1
        while self.answers:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            self.received.append((head, await reader.readexactly(length)))
            answer = self.answers.pop(0)
            if answer == b"close":
                break
            await asyncio.sleep(self.delay_s)
            writer.write(answer)
            await writer.drain()
        writer.close()


async def exchange(answers: list[bytes], requests: list[bytes]) -> tuple[list[bytes], FakeTriton]:
    triton = FakeTriton(answers)
    upstream = await asyncio.start_server(triton.handle, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    screen = HttpScreen(ScreenPolicy(max_body_bytes=2**20, public_models=frozenset({"text_embedding"})),
                        Upstream(f"127.0.0.1:{port}"))
    front = await asyncio.start_server(screen.serve, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", front.sockets[0].getsockname()[1])
    replies = []
    for request in requests:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        replies.append(head + await reader.readexactly(length))
    writer.close()
    front.close()
    upstream.close()
    return replies, triton


def request(body: bytes = BODY, model: str = "text_embedding", extra: bytes = b"") -> bytes:
    return (b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: triton\r\nContent-Length: %d\r\nCookie: secret\r\n"
            b"X-Padding: ppp\r\n%s\r\n" % (model.encode(), len(body), extra) + body)


def run(answers, requests):
    return asyncio.run(exchange(answers, requests))


def test_only_the_headers_triton_reads_are_forwarded_and_connections_are_reused():
    ok = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}'
    replies, triton = run([ok, ok], [request(extra=b"Inference-Header-Content-Length: %d\r\n" % len(BODY))] * 2)
    assert all(r.startswith(b"HTTP/1.1 200") and r.endswith(b"{}") for r in replies)
    head, body = triton.received[0]
    assert body == BODY
    names = {line.split(b":")[0].lower() for line in head.split(b"\r\n")[1:] if line}
    assert names == {b"host", b"inference-header-content-length", b"content-length"}
    assert triton.connections == 1  # keep-alive to Triton


def test_a_chunked_answer_is_passed_on_with_a_length():
    chunked = b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{"a\r\n4\r\n":1}\r\n0\r\n\r\n'
    (reply,), _ = run([chunked], [request()])
    assert b"Content-Length: 7" in reply and reply.endswith(b'{"a":1}') and b"chunked" not in reply


def test_a_dead_stub_becomes_a_retryable_503():
    error = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n%s" % (len(STUB_DEAD), STUB_DEAD)
    (reply,), _ = run([error], [request()])
    assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in reply and b"retry shortly" in reply


def test_triton_gone_is_a_503_and_refusals_never_reach_it():
    (gone, refused), triton = run([b"close", b"close"], [request(), request(model="text_encoder")])
    assert gone.startswith(b"HTTP/1.1 503") and b"restarting" in gone
    assert refused.startswith(b"HTTP/1.1 404") and b"unknown model 'text_encoder'" in refused
    assert len(triton.received) <= 2 and all(b"text_encoder" not in head for head, _ in triton.received)


@pytest.mark.parametrize("body,status", [(b"", b"400"), (b"null", b"400"), (b'{"inputs":[' + b"[" * 5000, b"400")])
def test_bad_bodies_are_answered_by_the_screen(body, status):
    (reply,), triton = run([], [request(body)])
    assert reply.startswith(b"HTTP/1.1 " + status) and b'{"error": ' in reply
    assert not triton.received


def test_a_refusal_on_a_stream_is_a_stream_response_with_its_error():
    from tritonclient.grpc import service_pb2

    from triton_pipelines.front.screen_server import stream_error_response

    for message in ("unknown model 'x'", "é" * 300):
        response = service_pb2.ModelStreamInferResponse.FromString(stream_error_response(message))
        assert response.error_message == message and not response.HasField("infer_response")


async def grpc_exchange(timeout: float | None, metadata: tuple) -> tuple:
    """One ModelInfer through a GrpcScreen to a fake Triton (grpc.aio) → the metadata Triton got."""
    import grpc

    from tests.unit.front.test_screen import grpc_request
    from triton_pipelines.front.screen_server import GRPC_INFER_METHOD, GrpcScreen

    seen = []

    async def infer(request, context):
        seen.append(tuple(context.invocation_metadata()))
        return b""

    class FakeTriton(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.unary_unary_rpc_method_handler(infer) if details.method == GRPC_INFER_METHOD else None

    triton = grpc.aio.server()
    triton.add_generic_rpc_handlers([FakeTriton()])
    triton_port = triton.add_insecure_port("127.0.0.1:0")
    await triton.start()
    screen = GrpcScreen(ScreenPolicy(max_body_bytes=2**20, public_models=frozenset({"text_embedding"})),
                        f"127.0.0.1:{triton_port}")
    front = grpc.aio.server()
    front.add_generic_rpc_handlers([screen.handler()])
    front_port = front.add_insecure_port("127.0.0.1:0")
    await front.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{front_port}") as channel:
        await channel.unary_unary(GRPC_INFER_METHOD)(grpc_request(), timeout=timeout, metadata=metadata)
    await front.stop(None)
    await triton.stop(None)
    return seen[0]


def test_a_grpc_deadline_reaches_the_models_as_the_screens_own_parameter():
    """Triton 2.51 never cancels an ensemble's running step (whisper_decode): the screen hands the
    call's deadline on (limits.CLIENT_DEADLINE_PARAMETER, ns since the epoch); a client's own value
    of that header never passes."""
    import time

    from triton_pipelines.limits import CLIENT_DEADLINE_PARAMETER

    forged = ((CLIENT_DEADLINE_PARAMETER, "1"),)
    before = time.time_ns()
    seen = asyncio.run(grpc_exchange(5.0, forged))
    values = [int(v) for k, v in seen if k == CLIENT_DEADLINE_PARAMETER]
    # gRPC's deadline clock is not the wall clock: a few ms either way (a 4 ms overshoot was seen)
    assert len(values) == 1 and before + 3 * 10**9 < values[0] <= time.time_ns() + 5 * 10**9 + 50 * 10**6
    assert not [v for k, v in asyncio.run(grpc_exchange(None, forged)) if k == CLIENT_DEADLINE_PARAMETER]
