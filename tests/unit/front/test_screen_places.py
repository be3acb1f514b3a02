"""The request screen's gRPC places (screen_server.GrpcScreen with front/places.py) between a real
gRPC client and a fake Triton (a grpc.aio server on loopback): a stream's requests each take a
place and the stream is held back past its share, a decoupled request gives its place back only
with its final response, an idle stream is closed, a ModelInfer request past the limit is refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from tritonclient.grpc import service_pb2

from triton_pipelines.front.nginx_config import CLIENT_ADDRESS_HEADER
from triton_pipelines.front.places import Places
from triton_pipelines.front.screen import ScreenPolicy
from triton_pipelines.front.screen_server import GRPC_INFER_METHOD, GRPC_STREAM_METHOD, GrpcScreen


def infer_request(model: str = "text_embedding", request_id: str = "") -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    tensor.contents.bytes_contents.append(b"hello")
    return request.SerializeToString()


class FakeTriton:
    """ModelStreamInfer: each request answered when the test releases it (``release``), with
    ``partials`` non-final responses first (a decoupled model); ModelInfer: answered at once."""

    def __init__(self, partials: int = 0):
        self.partials = partials
        self.received: list[str] = []
        self.released = asyncio.Queue()
        self.metadata: list[tuple] = []

    def release(self, count: int = 1) -> None:
        for _ in range(count):
            self.released.put_nowait(None)

    async def stream(self, requests, context):
        self.metadata.append(tuple(context.invocation_metadata()))
        pending: asyncio.Queue = asyncio.Queue()

        async def read():
            async for message in requests:
                request = service_pb2.ModelInferRequest.FromString(message)
                self.received.append(request.id)
                await pending.put(request.id)
            await pending.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (request_id := await pending.get()) is not None:
                await self.released.get()
                for index in range(self.partials + 1):
                    response = service_pb2.ModelStreamInferResponse()
                    response.infer_response.id = request_id
                    if self.partials:
                        response.infer_response.parameters["triton_final_response"].bool_param = index == self.partials
                    yield response.SerializeToString()
        finally:
            reader.cancel()

    async def infer(self, request, context):
        self.metadata.append(tuple(context.invocation_metadata()))
        await asyncio.sleep(0.3)
        return service_pb2.ModelInferResponse(model_name="text_embedding").SerializeToString()

    def handler(self):
        triton = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                if details.method == GRPC_STREAM_METHOD:
                    return grpc.stream_stream_rpc_method_handler(triton.stream)
                if details.method == GRPC_INFER_METHOD:
                    return grpc.unary_unary_rpc_method_handler(triton.infer)
                return None
        return Handler()


async def serve(handler) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def with_screen(triton: FakeTriton, places: Places, scenario, first_message_s: float = 5.0):
    triton_server, triton_address = await serve(triton.handler())
    screen = GrpcScreen(ScreenPolicy(max_body_bytes=2**20), triton_address, places=places,
                        first_message_s=first_message_s)
    screen_server, screen_address = await serve(screen.handler())
    channel = grpc.aio.insecure_channel(screen_address)
    try:
        await scenario(channel)
    finally:
        await channel.close()
        await screen_server.stop(None)
        await triton_server.stop(None)
        await screen.channel.close()


def client_metadata(address: str = "192.0.2.1") -> tuple:
    return ((CLIENT_ADDRESS_HEADER, address),)


async def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("partials", [0, 2])
def test_each_request_on_a_stream_takes_a_place_and_the_stream_waits_past_its_share(partials):
    """8 requests written back to back on one stream with a share of 2: Triton has at most 2 of
    them at a time; each gives its place back with its final response (after ``partials``
    non-final ones), and then the next is read."""
    triton = FakeTriton(partials)
    places = Places(4, per_client=2)

    async def scenario(channel):
        call = channel.stream_stream(GRPC_STREAM_METHOD)(metadata=client_metadata())
        for i in range(8):
            await call.write(infer_request(request_id=str(i)))
        await call.done_writing()
        await wait_for(lambda: len(triton.received) == 2)
        await asyncio.sleep(0.2)
        assert len(triton.received) == 2 and places.by_client == {"192.0.2.1": 2}
        # another client is not held back by this one
        assert places.try_take("192.0.2.2")
        places.give_back("192.0.2.2")
        responses = []
        for done in range(8):
            triton.release()
            for _ in range(partials + 1):
                responses.append(service_pb2.ModelStreamInferResponse.FromString(await call.read()))
            await wait_for(lambda done=done: len(triton.received) == min(8, done + 3))
            assert places.taken <= 2
        assert [r.infer_response.id for r in responses] == [str(i) for i in range(8) for _ in range(partials + 1)]
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        await wait_for(lambda: places.taken == 0)
        # nginx's client header does not reach Triton
        assert all(CLIENT_ADDRESS_HEADER not in dict(m) for m in triton.metadata)
    asyncio.run(with_screen(triton, places, scenario))


def test_a_cancelled_stream_gives_its_places_back():
    triton = FakeTriton()
    places = Places(4, per_client=2)

    async def scenario(channel):
        call = channel.stream_stream(GRPC_STREAM_METHOD)(metadata=client_metadata())
        for i in range(3):
            await call.write(infer_request(request_id=str(i)))
        await wait_for(lambda: len(triton.received) == 2)
        call.cancel()
        await wait_for(lambda: places.taken == 0 and places.waiting() == 0)
    asyncio.run(with_screen(triton, places, scenario))


def test_a_stream_that_sends_no_request_is_closed():
    triton = FakeTriton()
    places = Places(4)

    async def scenario(channel):
        call = channel.stream_stream(GRPC_STREAM_METHOD)(metadata=client_metadata())
        started = asyncio.get_running_loop().time()
        with pytest.raises(grpc.aio.AioRpcError) as closed:
            await call.read()
        assert closed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no request arrived within 0.3 s" in closed.value.details()
        assert asyncio.get_running_loop().time() - started < 3
        assert not triton.metadata  # no stream to Triton was opened for it
    asyncio.run(with_screen(triton, places, scenario, first_message_s=0.3))


def test_a_model_infer_request_past_the_limit_is_refused_at_once():
    triton = FakeTriton()
    places = Places(2, per_client=1)

    async def scenario(channel):
        infer = channel.unary_unary(GRPC_INFER_METHOD)
        first = asyncio.ensure_future(infer(infer_request(), metadata=client_metadata()))
        await wait_for(lambda: places.taken == 1)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await infer(infer_request(), metadata=client_metadata())
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "share of 1" in refused.value.details()
        assert ("retry-after", "1") in tuple(refused.value.trailing_metadata())
        # another address is served meanwhile
        await infer(infer_request(), metadata=client_metadata("192.0.2.2"))
        await first
        assert places.taken == 0
    asyncio.run(with_screen(triton, places, scenario))
