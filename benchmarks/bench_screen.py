"""What the request screen alone costs per request (python -m benchmarks.bench_screen): a client
sends one small text_embedding request at a time straight to a fake upstream that answers at once,
then through the screen (screen_server.HttpScreen / GrpcScreen) to the same upstream; the medians'
difference is the screen's parse + one more loopback hop. No Triton, no nginx: the server-side
picture is bench_proxy's (make bench). Client, screen and upstream share one event loop here, so
the gRPC numbers include the Python gRPC client's own cost twice."""

import asyncio, json, time, statistics
import grpc
from triton_pipelines.front.screen import ScreenPolicy
from triton_pipelines.front.screen_server import HttpScreen, GrpcScreen, GRPC_INFER_METHOD
from triton_pipelines.http1 import Upstream
from tritonclient.grpc import service_pb2

BODY = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["How do I reset my password?"]}]}).encode()
REQ = b"POST /v2/models/text_embedding/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

async def fake(reader, writer):
    while True:
        try: head = await reader.readuntil(b"\r\n\r\n")
        except Exception: break
        n = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
        await reader.readexactly(n); writer.write(ANSWER)

async def timed(port, n=3000):
    r, w = await asyncio.open_connection("127.0.0.1", port); ts = []
    for _ in range(n):
        t = time.perf_counter(); w.write(REQ); await r.readuntil(b"\r\n\r\n"); await r.readexactly(2); ts.append(time.perf_counter() - t)
    w.close(); return statistics.median(ts[200:]) * 1e6

async def http_main():
    up = await asyncio.start_server(fake, "127.0.0.1", 0); p = up.sockets[0].getsockname()[1]
    screen = HttpScreen(ScreenPolicy(2**26, frozenset({"text_embedding"})), Upstream(f"127.0.0.1:{p}"))
    front = await asyncio.start_server(screen.serve, "127.0.0.1", 0); f = front.sockets[0].getsockname()[1]
    for _ in range(2):
        d = await timed(p); s = await timed(f); print(f"HTTP: direct {d:.0f} us, through the screen {s:.0f} us, added {s-d:.0f} us")
    front.close(); up.close()

async def grpc_main():
    class Echo(grpc.GenericRpcHandler):
        def service(self, details):
            async def h(req, ctx): return b""
            return grpc.unary_unary_rpc_method_handler(h)
    up = grpc.aio.server(); up.add_generic_rpc_handlers((Echo(),)); p = up.add_insecure_port("127.0.0.1:0"); await up.start()
    screen = GrpcScreen(ScreenPolicy(2**26, frozenset({"text_embedding"})), f"127.0.0.1:{p}")
    srv = grpc.aio.server(); srv.add_generic_rpc_handlers((screen.handler(),)); f = srv.add_insecure_port("127.0.0.1:0"); await srv.start()
    req = service_pb2.ModelInferRequest(model_name="text_embedding"); t = req.inputs.add(name="text", datatype="BYTES"); t.shape.extend([1,1])
    req.raw_input_contents.append(b"\x1b\x00\x00\x00How do I reset my password?"); data = req.SerializeToString()
    async def timed_g(port, n=2000):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary(GRPC_INFER_METHOD); ts = []
            for _ in range(n):
                t0 = time.perf_counter(); await call(data); ts.append(time.perf_counter() - t0)
        return statistics.median(ts[200:]) * 1e6
    for _ in range(2):
        d = await timed_g(p); s = await timed_g(f); print(f"gRPC: direct {d:.0f} us, through the screen {s:.0f} us, added {s-d:.0f} us")
    await srv.stop(0); await up.stop(0)

if __name__ == "__main__":
    asyncio.run(http_main())
    asyncio.run(grpc_main())
