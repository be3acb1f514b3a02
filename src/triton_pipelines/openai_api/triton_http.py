"""Triton's unary inference over every replica's loopback HTTP port (``--triton-http``), HTTP/1.1 on
the event loop (``http1.py``)."""

from __future__ import annotations

import asyncio
import itertools
import json
from urllib.parse import quote

import numpy as np

from triton_pipelines.front.screen import restarting_model_message
from triton_pipelines.http1 import Upstream, read_body, read_head
from triton_pipelines.telemetry import tracing
from triton_pipelines.telemetry.tracing import propagation_headers
from triton_pipelines.openai_api import protocol as proto


# Triton's HTTP statuses → the gRPC status names ``triton_error`` reads (Triton derives both from one
# error code: INVALID_ARG 400, NOT_FOUND 404, UNAVAILABLE 503, INTERNAL 500, ...).
HTTP_STATUS_NAMES = {400: "StatusCode.INVALID_ARGUMENT", 404: "StatusCode.NOT_FOUND", 409: "StatusCode.ALREADY_EXISTS",
                     429: "StatusCode.RESOURCE_EXHAUSTED", 499: "StatusCode.CANCELLED", 500: "StatusCode.INTERNAL",
                     501: "StatusCode.UNIMPLEMENTED", 503: "StatusCode.UNAVAILABLE", 504: "StatusCode.DEADLINE_EXCEEDED"}


class TritonHttp:
    """Unary inference over every replica's loopback HTTP port (``--triton-http``): keep-alive
    HTTP/1.1 on the event loop itself (``http1.Upstream``'s pool), tensors in binary form
    and the JSON header written here (small: Triton's JSON limits are never near). Per call it costs
    ~0.2 ms of CPU against ~0.85 ms for a ``grpc.aio`` call, whose answer crosses two grpc threads
    before it reaches the event loop (docs/openai.md). Round robin; a replica that answers 503 or
    cannot be reached is skipped for the next. Failures are ``InferenceServerException`` with the
    gRPC status names ``triton_error`` reads."""

    def __init__(self, addresses: list[str], grpcclient):
        self.addresses = list(addresses)
        self.upstreams = [Upstream(a) for a in addresses]
        self.grpcclient = grpcclient
        self.turn = itertools.count()

    async def infer_bytes(self, model: str, name: str, values: list[bytes], output: str,
                          timeout_s: float) -> np.ndarray:
        raw = b"".join(len(v).to_bytes(4, "little") + v for v in values)
        header = json.dumps({"inputs": [{"name": name, "shape": [len(values), 1], "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(raw)}}],
                             "outputs": [{"name": output, "parameters": {"binary_data": True}}]},
                            separators=(",", ":")).encode()
        start = next(self.turn)
        error = None
        trace = "".join(f"{k}: {v}\r\n" for k, v in propagation_headers()) if tracing.enabled() else ""
        for i in range(len(self.upstreams)):
            index = (start + i) % len(self.upstreams)
            head = (f"POST /v2/models/{quote(model, safe='')}/infer HTTP/1.1\r\nHost: {self.addresses[index]}\r\n"
                    f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {len(header)}\r\n"
                    f"Content-Length: {len(header) + len(raw)}\r\n{trace}\r\n").encode()
            try:
                status, headers, body = await asyncio.wait_for(
                    self._exchange(self.upstreams[index], head + header + raw), timeout_s)
            except asyncio.TimeoutError:
                raise self.grpcclient.InferenceServerException(
                    msg="Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED") from None
            except (OSError, asyncio.IncompleteReadError) as failure:
                error = self.grpcclient.InferenceServerException(
                    msg=f"failed to connect to the inference server: {failure}", status="StatusCode.UNAVAILABLE")
                continue
            if status == 200:
                return http_fp32_output(headers, body, output)
            try:
                message = str(json.loads(body).get("error", ""))
            except (ValueError, AttributeError):
                message = body[:300].decode("utf-8", "replace")
            error = self.grpcclient.InferenceServerException(
                msg=message, status=HTTP_STATUS_NAMES.get(status, f"HTTP {status}"))
            # a replica that is restarting, or whose model lost its stub: the next one may serve
            if status != 503 and not restarting_model_message(message):
                raise error
        raise error

    @staticmethod
    async def _exchange(upstream, message: bytes) -> tuple[int, list, bytes]:
        for attempt in (0, 1):
            reader, writer, reused = await upstream.connection()
            try:
                writer.write(message)
                answer = await read_head(reader)
                if answer is None:
                    raise ConnectionResetError("Triton closed the connection")
                status_line, headers = answer
                body = await read_body(reader, headers)
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                writer.close()
                # Triton closes idle keep-alive connections: only a pooled one is tried again
                if attempt == 0 and reused:
                    continue
                raise
            except BaseException:  # cancelled or timed out mid-answer: the connection is unusable
                writer.close()
                raise
            keep = dict(headers).get(b"connection", b"").lower() != b"close"
            upstream.release(reader, writer, keep)
            return int(status_line.split(b" ")[1]), headers, body
        raise AssertionError("unreachable")

    async def close(self):
        for upstream in self.upstreams:
            while upstream.idle:
                upstream.idle.pop()[1].close()


def http_fp32_output(headers: list, body: bytes, name: str) -> np.ndarray:
    """The FP32 output ``name`` of Triton's binary HTTP answer (JSON header, then the binary outputs
    in the header's order)."""
    length = dict(headers).get(b"inference-header-content-length")
    try:
        size = int(length) if length is not None else len(body)
        document = json.loads(body[:size])
        offset = size
        for tensor in document.get("outputs", ()):
            binary = int(tensor.get("parameters", {}).get("binary_data_size", 0) or 0)
            if tensor.get("name") == name:
                if tensor.get("datatype") != "FP32" or binary != 4 * int(np.prod(tensor["shape"])):
                    break
                return np.frombuffer(body, dtype="<f4", count=binary // 4, offset=offset).reshape(tensor["shape"])
            offset += binary
    except (ValueError, KeyError, TypeError):
        pass
    raise proto.internal(f"the model's answer has no binary FP32 output '{name}'")
