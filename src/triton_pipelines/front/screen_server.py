"""The request screen's servers: one process per tritonserver replica, between nginx and Triton.

nginx sends every inference request here (HTTP ``/v2/models/<m>/infer`` with its whole body, gRPC
``ModelInfer``); each is checked (``screen.py``) and either refused with a clear error or forwarded,
byte for byte, to its replica's loopback ports. Triton's answer comes back unchanged, except that
a request that met a dead Python stub becomes a retryable 503 / ``UNAVAILABLE``. Metadata, health
and statistics go from nginx to Triton directly.

    python -m triton_pipelines screen --http-port P --grpc-port Q \\
        --triton-http 127.0.0.1:A --triton-grpc 127.0.0.1:B --max-body-bytes N [--public-models-file F] \\
        [--max-inflight M --max-inflight-per-client C --replicas R --replica-index I]

gRPC requests are counted here, not in nginx (``places.py``): this replica's part of the server's
``--max-inflight`` (and of a client's share), one place per ``ModelInfer`` request once its message
has arrived and per request message of a ``ModelStreamInfer`` stream until its final response.

HTTP from nginx is well-formed HTTP/1.1 with a ``Content-Length`` (nginx buffered the body); the
forwarder speaks exactly that, with a pool of keep-alive connections to Triton (``http1.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
import time
from collections import deque
from pathlib import Path
from urllib.parse import unquote

from triton_pipelines.cancel_board import CancelBoard, new_id
from triton_pipelines.limits import (CLIENT_CANCEL_PARAMETER, CLIENT_DEADLINE_PARAMETER, DEFAULT_MAX_INFLIGHT,
                                    DEFAULT_MAX_INFLIGHT_BYTES, REQUEST_TIMEOUT_S, STREAM_FIRST_MESSAGE_S,
                                    client_deadline_value, client_share, replica_part)
from triton_pipelines.gateway.keys import KEY_ID_PARAMETER, KeyRing, bearer_secret, keys_from_environment
from triton_pipelines.errors import REFUSAL_STATUSES, parse_refusal
from triton_pipelines.http1 import Upstream, header, read_body, read_head
from triton_pipelines.front.nginx_config import CLIENT_ADDRESS_HEADER, MESSAGES, grpc_overloaded_message
from triton_pipelines.front.places import Places, byte_budget, bytes_overloaded_message
from triton_pipelines.telemetry.front import TRACE_HEADERS, metadata_value, screen_trace
from triton_pipelines.front.screen import (ScreenError, ScreenPolicy, check_grpc_request, check_http_request,
                                           is_final_response, restarting_model_message)

GRPC_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
# Streaming inference (decoupled models: speech_recognition_stream): every request message of the
# stream is screened like a ModelInfer request before it is forwarded.
GRPC_STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
_INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]*))?/infer$")
_CLIENT_ADDRESS = CLIENT_ADDRESS_HEADER.encode()
_HOP_HEADERS = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"proxy-connection"}
# The only request headers Triton's inference endpoint reads; no other client header reaches it.
_FORWARDED_HEADERS = {b"host", b"content-type", b"inference-header-content-length", b"accept-encoding"}
UPSTREAM_TIMEOUT_S = REQUEST_TIMEOUT_S
# How often an HTTP request waiting for Triton's answer looks whether its client (nginx's
# connection) has gone, to mark it on the cancel board.
CLIENT_CHECK_S = 0.2
# The model whose requests carry an API key (gateway tasks: budgets, limits, the spend ledger).
KEYED_MODEL = "router"
_TRANSPORT_FAILURE = re.compile(r"failed to connect|connection refused|socket closed|connection reset|"
                                r"Broken pipe|endpoint is closed", re.IGNORECASE)


def http_response(status: int, body: bytes, extra: list[tuple[bytes, bytes]] = ()) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found",
              411: b"Length Required", 429: b"Too Many Requests", 502: b"Bad Gateway",
              503: b"Service Unavailable"}.get(status, b"Error")
    head = [b"HTTP/1.1 %d %s" % (status, reason), b"Content-Type: application/json",
            b"Content-Length: %d" % len(body)] + [name + b": " + value for name, value in extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def key_id_for(keys: KeyRing | None, authorization: str | None) -> str | None:
    """The id of the key in ``Authorization: Bearer <key>``; None without a key (the router then
    refuses gateway tasks when a keys file is configured). ScreenError 401 for an unknown key.
    Without a keys file, requests are open and a bearer is ignored."""
    if keys is None:
        return None
    secret = bearer_secret(authorization)
    if secret is None:
        return None
    key = keys.lookup(secret)
    if key is None:
        raise ScreenError("the API key is not known to this server", 401, "UNAUTHENTICATED")
    return key.key_id


def refused_answer(status: int, body: bytes) -> bytes | None:
    """A router refusal (errors.refusal_text's marker in Triton's error) as its own status, with
    Retry-After; None for any other answer."""
    if status not in (400, 503) or b"[refused " not in body[:64]:
        return None
    try:
        found = parse_refusal(json.loads(body).get("error", ""))
    except ValueError:
        return None
    if found is None:
        return None
    refused, retry_after, message = found
    return http_response(refused, error_body(message),
                         [(b"Retry-After", str(retry_after).encode())] if retry_after is not None else [])


async def discard(reader: asyncio.StreamReader, length: int, chunk: int = 2**20) -> None:
    """Reads ``length`` bytes of a body and keeps none of them (a refused request's)."""
    while length > 0:
        length -= len(await reader.readexactly(min(chunk, length)))


TRITON_GONE = http_response(503, error_body("the inference server is starting or restarting: retry shortly"),
                            [(b"Retry-After", b"1")])


class HttpScreen:
    """``request_bytes``: the request bytes in flight (shared with the gRPC screen of the same
    process); a request whose body does not fit is answered 503 before its body is kept."""

    def __init__(self, policy: ScreenPolicy, upstream: Upstream, keys: KeyRing | None = None,
                 request_bytes: Places | None = None, board: CancelBoard | None = None):
        self.policy, self.upstream, self.keys, self.board = policy, upstream, keys, board
        self.request_bytes = request_bytes or byte_budget(DEFAULT_MAX_INFLIGHT_BYTES, None, policy.max_body_bytes)
        self.bytes_overloaded = http_response(503, error_body(bytes_overloaded_message(self.request_bytes)),
                                              [(b"Retry-After", b"1")])

    def check(self, target: bytes, headers, body: bytes) -> str:
        """Refuses (ScreenError) or returns the model's name."""
        path = unquote(target.split(b"?", 1)[0].decode("latin-1"))
        found = _INFER_PATH.match(path)
        if found is None:
            raise ScreenError("not found", 404, "NOT_FOUND")
        json_length = header(headers, b"inference-header-content-length")
        if json_length is not None and not json_length.strip().isdigit():  # nginx lets an empty one by
            raise ScreenError(MESSAGES["bad_header_length"])
        size = len(body) if json_length is None else int(json_length)
        if size > len(body):
            raise ScreenError(f"Inference-Header-Content-Length ({size}) is longer than the body ({len(body)} bytes)")
        check_http_request(self.policy, found.group(1), found.group(2) or "", body[:size], len(body) - size)
        return found.group(1)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await read_head(reader)
                if head is None:
                    break
                request_line, headers = head
                if header(headers, b"transfer-encoding") is not None:
                    writer.write(http_response(411, error_body("send a Content-Length")))
                    break
                length = int(header(headers, b"content-length") or 0)
                client = (header(headers, _CLIENT_ADDRESS) or b"").decode("latin-1")
                if not self.request_bytes.try_take(client, length):
                    await discard(reader, length)
                    writer.write(self.bytes_overloaded)
                    await writer.drain()
                    continue
                try:
                    answer = await self.screened(reader, request_line, headers, length)
                finally:
                    self.request_bytes.give_back(client, length)
                writer.write(answer)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError):
            pass
        finally:
            writer.close()

    async def screened(self, reader: asyncio.StreamReader, request_line: bytes, headers, length: int) -> bytes:
        """One request whose bytes are counted: its body read, checked, forwarded; the answer."""
        body = await reader.readexactly(length)
        try:
            model = self.check(request_line.split(b" ")[1], headers, body)
            extra = []
            if model == KEYED_MODEL:
                authorization = header(headers, b"authorization")
                key_id = key_id_for(self.keys, authorization.decode("latin-1") if authorization else None)
                if key_id:
                    extra.append((KEY_ID_PARAMETER.encode(), key_id.encode()))
        except ScreenError as error:
            return http_response(error.status, error_body(str(error)))
        traced = screen_trace("http", model, header(headers, b"traceparent"), header(headers, b"tracestate"))
        request_id = new_id() if self.board is not None else None
        if request_id:
            extra.append((CLIENT_CANCEL_PARAMETER.encode(), request_id.encode()))
        answer = self.forward(request_line, headers, body, extra + traced.http_headers())
        if request_id:
            answer = self.unless_gone(asyncio.ensure_future(answer), reader, request_id)
        return traced.http_answer(await answer)

    async def unless_gone(self, answer: asyncio.Future, reader: asyncio.StreamReader, request_id: str) -> bytes:
        """Triton's ``answer``; meanwhile, a client that closes its connection (nginx does when its
        own client leaves) has its request marked on the cancel board: a long model stops for it."""
        while True:
            done, _ = await asyncio.wait({answer}, timeout=CLIENT_CHECK_S)
            if done:
                return answer.result()
            if reader.at_eof() or reader.exception() is not None:
                self.board.mark(request_id)
                return await answer  # soon (the model stops), and then for nobody

    async def forward(self, request_line: bytes, headers, body: bytes, extra=()) -> bytes:
        head = [request_line] + [name + b": " + value for name, value in headers if name in _FORWARDED_HEADERS]
        head += [name + b": " + value for name, value in extra]
        head.append(b"Content-Length: %d" % len(body))
        message = b"\r\n".join(head) + b"\r\n\r\n"
        for attempt in (0, 1):
            reused = False
            try:
                reader, writer, reused = await self.upstream.connection()
            except OSError:
                return TRITON_GONE
            try:
                writer.write(message)
                writer.write(body)
                await writer.drain()
                answer = await asyncio.wait_for(read_head(reader), UPSTREAM_TIMEOUT_S)
                if answer is None:
                    raise ConnectionResetError("Triton closed the connection")
                status_line, response_headers = answer
                response_body = await asyncio.wait_for(read_body(reader, response_headers), UPSTREAM_TIMEOUT_S)
            except (ConnectionError, asyncio.IncompleteReadError, OSError) as error:
                writer.close()
                # Only a pooled connection is tried again: Triton closes idle keep-alive connections,
                # and one it had closed read nothing. (A Triton that died mid-request refuses the retry.)
                if attempt == 0 and reused and not isinstance(error, asyncio.IncompleteReadError):
                    continue
                return TRITON_GONE
            except asyncio.TimeoutError:
                writer.close()
                return http_response(503, error_body("the inference server did not answer in time"))
            keep = (header(response_headers, b"connection") or b"").lower() != b"close"
            self.upstream.release(reader, writer, keep)
            status = int(status_line.split(b" ")[1])
            refused = refused_answer(status, response_body)
            if refused is not None:
                return refused
            if status == 500:
                restarting = restarting_model_message(response_body.decode("utf-8", "replace"))
                if restarting:
                    return http_response(503, error_body(restarting), [(b"Retry-After", b"1")])
            out = [status_line] + [name + b": " + value for name, value in response_headers
                                   if name not in _HOP_HEADERS and name != b"content-length"]
            out.append(b"Content-Length: %d" % len(response_body))
            return b"\r\n".join(out) + b"\r\n\r\n" + response_body
        raise AssertionError("unreachable")


class GrpcScreen:
    """ModelInfer and ModelStreamInfer, as raw bytes both ways: checked, counted (``places``), then
    forwarded with the caller's metadata and deadline; the caller's cancellation cancels the
    forwarded call. ``overloaded``: the answer when there is no place for a ModelInfer request."""

    # authorization: the key's secret never reaches Triton (its id does, for the router); the
    # deadline header is the screen's own (client_deadline)
    _DROP = {"user-agent", "grpc-accept-encoding", "grpc-encoding", "te", "content-type", "authorization",
             KEY_ID_PARAMETER, CLIENT_DEADLINE_PARAMETER, CLIENT_CANCEL_PARAMETER, CLIENT_ADDRESS_HEADER,
             *TRACE_HEADERS}

    def __init__(self, policy: ScreenPolicy, triton_grpc: str, keys: KeyRing | None = None,
                 places: Places | None = None, overloaded: str = "", first_message_s: float = STREAM_FIRST_MESSAGE_S,
                 request_bytes: Places | None = None, board: CancelBoard | None = None):
        import grpc

        self.grpc = grpc
        self.board = board
        self.policy = policy
        self.keys = keys
        self.places = places or Places(DEFAULT_MAX_INFLIGHT)
        self.request_bytes = request_bytes or byte_budget(DEFAULT_MAX_INFLIGHT_BYTES, None, policy.max_body_bytes)
        self.bytes_overloaded = bytes_overloaded_message(self.request_bytes)
        self.overloaded = overloaded or grpc_overloaded_message(self.places.capacity, self.places.per_client)
        self.first_message_s = first_message_s
        self.channel = grpc.aio.insecure_channel(triton_grpc, options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        self.call = self.channel.unary_unary(GRPC_INFER_METHOD)
        self.stream_call = self.channel.stream_stream(GRPC_STREAM_METHOD)

    def handler(self):
        grpc = self.grpc
        screen = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                if details.method == GRPC_INFER_METHOD:
                    return grpc.unary_unary_rpc_method_handler(screen.infer)
                if details.method == GRPC_STREAM_METHOD:
                    return grpc.stream_stream_rpc_method_handler(screen.stream)
                return None
        return Handler()

    async def infer(self, request: bytes, context) -> bytes:
        grpc = self.grpc
        received = context.invocation_metadata() or ()
        try:
            model = check_grpc_request(self.policy, request)
            key_id = None
            if model == KEYED_MODEL:
                authorization = next((v for k, v in received if k == "authorization"), None)
                key_id = key_id_for(self.keys, authorization if isinstance(authorization, str) else None)
        except ScreenError as error:
            await context.abort(getattr(grpc.StatusCode, error.grpc_code), str(error))
        metadata = tuple((k, v) for k, v in received if k not in self._DROP)
        if key_id:
            metadata += ((KEY_ID_PARAMETER, key_id),)
        remaining = context.time_remaining()
        metadata += client_deadline(remaining)
        client = client_address(received)
        if not self.places.try_take(client):
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.overloaded, (("retry-after", "1"),))
        if not self.request_bytes.try_take(client, len(request)):
            self.places.give_back(client)
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.bytes_overloaded, (("retry-after", "1"),))
        traced = screen_trace("grpc", model, metadata_value(received, "traceparent"),
                              metadata_value(received, "tracestate"))
        request_id = new_id() if self.board is not None else None
        if request_id:
            metadata += ((CLIENT_CANCEL_PARAMETER, request_id),)
        try:
            return await self.call(request, timeout=remaining, metadata=metadata + traced.grpc_metadata(context))
        except asyncio.CancelledError:  # the caller cancelled: a running model step stops by the board
            if request_id:
                self.board.mark(request_id)
            raise
        except grpc.aio.AioRpcError as error:
            traced.end(error.code().name)
            await self._abort_with(context, error)
        finally:
            self.places.give_back(client)
            self.request_bytes.give_back(client, len(request))
            traced.end()

    async def _abort_with(self, context, error) -> None:
        """Triton's failure of a ModelInfer call, as the caller should see it."""
        grpc = self.grpc
        code, details = error.code(), error.details() or ""
        restarting = restarting_model_message(details) if code == grpc.StatusCode.INTERNAL else None
        refused = parse_refusal(details) if code in (grpc.StatusCode.UNAVAILABLE,
                                                     grpc.StatusCode.INVALID_ARGUMENT) else None
        if refused is not None:
            status, retry_after, message = refused
            trailing = (("retry-after", str(retry_after)),) if retry_after is not None else ()
            await context.abort(getattr(grpc.StatusCode, REFUSAL_STATUSES[status]), message, trailing)
        if restarting:
            code, details = grpc.StatusCode.UNAVAILABLE, restarting
        elif code == grpc.StatusCode.UNAVAILABLE and _TRANSPORT_FAILURE.search(details):
            # Triton itself is not there (a restart): say so, not the channel's internals. A
            # model's own UNAVAILABLE (e.g. the router's "gateway not configured") passes as is.
            details = "the inference server is starting or restarting: retry shortly"
        await context.abort(code, details)


    async def stream(self, requests, context):
        """ModelStreamInfer: each request message checked, given a place (the stream is not read on
        while there is none for this client), then written to Triton's stream; the place is given
        back with that request's final response (``is_final_response``). Triton's responses come
        back as they are. A refused message is answered on the stream with its error (as Triton
        answers a failed request there) and the stream goes on; a stream that sends no request
        within ``first_message_s`` is closed; the caller's cancellation cancels the forwarded stream."""
        grpc = self.grpc
        received = context.invocation_metadata() or ()
        metadata = tuple((k, v) for k, v in received if k not in self._DROP)
        client = client_address(received)
        messages = requests.__aiter__()
        try:
            first = await asyncio.wait_for(messages.__anext__(), self.first_message_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request arrived within {self.first_message_s:g} s of the stream's start: "
                                "an idle stream is closed (send the first request when it opens)")
        traced = screen_trace("grpc", "stream", metadata_value(received, "traceparent"),
                              metadata_value(received, "tracestate"))  # one span for the whole stream
        stream_id = new_id() if self.board is not None else None  # every request of the stream's
        metadata += ((CLIENT_CANCEL_PARAMETER, stream_id),) if stream_id else ()
        call = self.stream_call(timeout=context.time_remaining(), metadata=metadata + traced.grpc_metadata(context))
        # Triton's responses and our refusals, in order; bounded, so a client that sends refused
        # messages without reading the answers is held back (it is no longer read) instead of queued.
        answers: asyncio.Queue = asyncio.Queue(maxsize=64)
        upstream_done = object()
        held: deque[int] = deque()  # this stream's requests in Triton, by size: a place and their bytes
        # until their final responses (given back oldest first: a stream's requests end about in order)

        async def forward():
            request = first
            try:
                while True:
                    try:
                        check_grpc_request(self.policy, request)
                    except ScreenError as error:
                        await answers.put(stream_error_response(str(error)))
                    else:
                        if await self.take(client, len(request), answers):
                            held.append(len(request))
                            await call.write(request)
                    try:
                        request = await messages.__anext__()
                    except StopAsyncIteration:
                        break
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the upstream call ended; its status is read below

        async def backward():
            try:
                async for response in call:
                    if held and is_final_response(response):
                        self.give_back(client, held.popleft())
                    await answers.put(response)
                await answers.put(upstream_done)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - handed to the caller's side below
                await answers.put(error)

        pump, drain = asyncio.ensure_future(forward()), asyncio.ensure_future(backward())
        try:
            while (answer := await answers.get()) is not upstream_done:
                if isinstance(answer, grpc.aio.AioRpcError):
                    await context.abort(answer.code(), answer.details() or "")
                if isinstance(answer, Exception):
                    raise answer
                yield answer
        finally:
            pump.cancel()
            drain.cancel()
            call.cancel()
            await asyncio.gather(pump, drain, return_exceptions=True)
            traced.end()
            self.stream_ended(client, held, stream_id)

    def stream_ended(self, client: str, held: deque, stream_id: str | None) -> None:
        """Requests whose final response never came (cancelled, failed stream): marked on the
        cancel board (Triton may still be running them) and their places given back."""
        if held and stream_id:
            self.board.mark(stream_id)
        while held:
            self.give_back(client, held.popleft())

    async def take(self, client: str, size: int, answers: asyncio.Queue) -> bool:
        """A place and ``size`` bytes for a stream's request, waiting until they are free; False (and
        the refusal answered on the stream) for a request that could never fit."""
        if not self.request_bytes.fits(size):
            await answers.put(stream_error_response(self.bytes_overloaded))
            return False
        await self.places.take(client)
        try:
            await self.request_bytes.take(client, size)
        except BaseException:
            self.places.give_back(client)
            raise
        return True

    def give_back(self, client: str, size: int) -> None:
        """A stream's request is done: its place and its bytes."""
        self.places.give_back(client)
        self.request_bytes.give_back(client, size)


def client_address(metadata) -> str:
    """The client's address as nginx passed it (``CLIENT_ADDRESS_HEADER``); "" when it came
    another way (loopback tools, tests of the screen alone)."""
    return next((v for k, v in metadata if k == CLIENT_ADDRESS_HEADER and isinstance(v, str)), "")


def client_deadline(remaining_s: float | None, now_ns: int | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata that tells the models a unary call's deadline (``limits.CLIENT_DEADLINE_PARAMETER``,
    ns since the epoch): Triton cancels the call at its deadline, but not an ensemble's step that is
    already running (whisper_decode), which stops by this instead. None without a deadline."""
    if remaining_s is None:
        return ()
    now_ns = time.time_ns() if now_ns is None else now_ns
    return ((CLIENT_DEADLINE_PARAMETER, client_deadline_value(remaining_s, now_ns)),)


def stream_error_response(message: str) -> bytes:
    """A serialized ModelStreamInferResponse carrying only ``error_message`` (field 1): what a
    stream client's callback receives as the error of one request."""
    data = message.encode("utf-8")
    size, length = bytearray(), len(data)
    while True:
        size.append((length & 0x7F) | (0x80 if length > 0x7F else 0))
        length >>= 7
        if not length:
            break
    return b"\x0a" + bytes(size) + data


def load_public_models(path: Path | None) -> frozenset[str] | None:
    if path is None:
        return None
    names = json.loads(path.read_text())
    return None if names is None else frozenset(names)


async def run(args: argparse.Namespace) -> None:
    import grpc

    policy = ScreenPolicy(max_body_bytes=args.max_body_bytes, public_models=load_public_models(args.public_models_file))
    share = client_share(args.max_inflight, args.max_inflight_per_client)
    places = Places(replica_part(args.max_inflight, args.replicas, args.replica_index),
                    replica_part(share, args.replicas, args.replica_index))
    keys = keys_from_environment()  # $TRITON_API_KEYS_FILE: None serves the router open
    request_bytes = byte_budget(args.max_inflight_bytes, args.max_inflight_bytes_per_client, args.max_body_bytes,
                                args.replicas, args.replica_index)
    board = CancelBoard(args.cancel_board) if args.cancel_board else None
    http = HttpScreen(policy, Upstream(args.triton_http), keys, request_bytes, board)
    http_server = await asyncio.start_server(http.serve, "127.0.0.1", args.http_port, limit=2**20, backlog=4096)
    grpc_screen = GrpcScreen(policy, args.triton_grpc, keys, places, grpc_overloaded_message(args.max_inflight, share),
                             args.stream_first_message_s, request_bytes, board)
    grpc_server = grpc.aio.server(options=[
        # nginx bounds a message (client_max_body_size) with its own clear message; a limit here
        # would answer first, from the message's length prefix, in gRPC's words.
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_concurrent_streams", 4096)])
    grpc_server.add_generic_rpc_handlers((grpc_screen.handler(),))
    if grpc_server.add_insecure_port(f"127.0.0.1:{args.grpc_port}") == 0:
        raise SystemExit(f"cannot listen on 127.0.0.1:{args.grpc_port}")
    await grpc_server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    http_server.close()
    await grpc_server.stop(grace=5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--triton-http", required=True)
    parser.add_argument("--triton-grpc", required=True)
    parser.add_argument("--max-body-bytes", type=int, required=True)
    parser.add_argument("--public-models-file", type=Path)
    parser.add_argument("--cancel-board", type=Path, help="the replica's cancel board folder (cancel_board.py)")
    # The server's gRPC limits (every replica's screen together) and this screen's part of them.
    parser.add_argument("--max-inflight", type=int, default=DEFAULT_MAX_INFLIGHT)
    parser.add_argument("--max-inflight-per-client", type=int, default=None, help="default: half of --max-inflight")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--replica-index", type=int, default=0)
    parser.add_argument("--stream-first-message-s", type=float, default=STREAM_FIRST_MESSAGE_S)
    # The server's request bytes in flight (every replica's screen together) and one client's share.
    parser.add_argument("--max-inflight-bytes", type=int, default=DEFAULT_MAX_INFLIGHT_BYTES)
    parser.add_argument("--max-inflight-bytes-per-client", type=int, default=None,
                        help="default: half of --max-inflight-bytes")
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
