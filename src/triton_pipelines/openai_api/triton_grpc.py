"""Triton over every replica's loopback gRPC port (``tritonclient.grpc.aio`` and plain ``grpc.aio``
stubs), and what a tritonclient failure becomes for a ``/v1`` client (``triton_error``; the HTTP
client's failures read the same)."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np

from triton_pipelines.errors import INPUT_ERROR_PREFIX
from triton_pipelines.front.screen import restarting_model_message
from triton_pipelines.openai_api import protocol as proto
from triton_pipelines.telemetry import tracing
from triton_pipelines.telemetry.tracing import propagation_headers


# The Python backend appends the stub's traceback to an exception that escapes execute:
# "<message>\n\nAt:\n  <file>(<line>): <function>\n...". A client never sees it.
TRACEBACK_MARK = "\n\nAt:\n"


def one_line(message: str) -> str:
    """Triton's error message without a stub's traceback, on one line."""
    return " ".join(message.split(TRACEBACK_MARK, 1)[0].split())


def triton_error(error: Exception, what: str) -> proto.OpenAIError:
    """A tritonclient failure → the OpenAI error a client gets (one line, no traceback)."""
    status = str(getattr(error, "status", lambda: "")() or "")
    message = one_line(str(getattr(error, "message", lambda: "")() or error))
    message = message.removeprefix("[StatusCode.INVALID_ARGUMENT] ")
    if "INVALID_ARGUMENT" in status or INPUT_ERROR_PREFIX in message:
        text = message.split(INPUT_ERROR_PREFIX, 1)[-1]
        return proto.invalid(f"{what}: {text}", "file" if what == "audio" else "input")
    restarting = restarting_model_message(message)
    if restarting:  # a dead Python stub: the launcher is reloading that model
        return proto.unavailable(f"{what}: {restarting}")
    if "DEADLINE_EXCEEDED" in status or "Deadline" in message:
        return proto.OpenAIError(504, f"{what}: the model did not answer in time", "server_error", None, "timeout")
    if any(s in status for s in ("UNAVAILABLE", "NOT_FOUND", "CANCELLED")) or "not ready" in message \
            or "unknown model" in message or "restarting" in message:
        return proto.unavailable(f"{what}: the model is not available right now ({message[:200]})")
    return proto.internal(f"{what}: {message[:300]}")


class Triton:
    """Clients of every replica's loopback gRPC port; requests go round robin, and a replica that
    refuses (restarting) is skipped for the next.

    Unary inference (``/v1/embeddings``) is a plain ``grpc.aio`` stub call with a
    ``ModelInferRequest`` built here, tensors in ``raw_input_contents`` / ``raw_output_contents``:
    tritonclient's ``InferInput``/``InferResult`` wrappers cost more CPU per call than the rest of
    the request's handling. Streams (audio) use ``tritonclient.grpc.aio``."""

    def __init__(self, addresses: list[str]):
        import grpc
        import tritonclient.grpc.aio as grpcclient
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.grpc, self.grpcclient, self.pb = grpc, grpcclient, service_pb2
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self.clients = [grpcclient.InferenceServerClient(a, channel_args=options) for a in addresses]
        self.channels = [grpc.aio.insecure_channel(a, options=options) for a in addresses]
        self.model_infer = [service_pb2_grpc.GRPCInferenceServiceStub(c).ModelInfer for c in self.channels]
        self.turn = itertools.count()

    def order(self) -> list[int]:
        start = next(self.turn)
        return [(start + i) % len(self.clients) for i in range(len(self.clients))]

    def infer(self, request, timeout_s: float, fp32: str | None = None):
        """``ModelInferRequest`` → an awaitable of its ``ModelInferResponse`` (or, with ``fp32``, of
        that FP32 output as an array). The call is started here (the request goes out at the event
        loop's next turn, before the awaitable is awaited); failures are tritonclient's
        ``InferenceServerException``, as ``triton_error`` reads them."""
        order = self.order()
        metadata = tuple(propagation_headers()) or None if tracing.enabled() else None  # the caller's span
        return self._answer(self.model_infer[order[0]](request, timeout=timeout_s, metadata=metadata), request,
                            order[1:], timeout_s, fp32, metadata)

    async def _answer(self, call, request, others: list[int], timeout_s: float, fp32: str | None, metadata=None):
        while True:
            try:
                response = await call
                return response if fp32 is None else fp32_output(response, fp32)
            except self.grpc.aio.AioRpcError as failure:
                error = self.grpcclient.InferenceServerException(
                    msg=failure.details(), status=str(failure.code()), debug_details=failure.debug_error_string())
            # a replica that is restarting, or whose model lost its stub: the next one may serve
            if not others or ("UNAVAILABLE" not in error.status() and not restarting_model_message(str(error))):
                raise error
            call = self.model_infer[others.pop(0)](request, timeout=timeout_s, metadata=metadata)

    def stream(self, model: str, inputs: list, parameters: dict, timeout_s: float):
        """One request on a ModelStreamInfer stream → (call, async iterator of (result, error)); the
        request side stays open until ``done`` is set (Triton then has every response)."""
        done = asyncio.Event()

        async def requests():
            yield {"model_name": model, "inputs": inputs, "parameters": parameters}
            await done.wait()

        client = self.clients[self.order()[0]]
        headers = dict(propagation_headers()) or None if tracing.enabled() else None  # the caller's span
        call = client.stream_infer(requests(), stream_timeout=timeout_s, headers=headers)
        return call, done

    async def close(self):
        for client in self.clients:
            await client.close()
        for channel in self.channels:
            await channel.close()


def bytes_input(grpcclient, name: str, values: list[bytes]):
    tensor = grpcclient.InferInput(name, [len(values), 1], "BYTES")
    tensor.set_data_from_numpy(np.array(values, dtype=np.object_).reshape(-1, 1))
    return tensor


def bool_input(grpcclient, name: str, value: bool):
    """One BOOL ``[1, 1]`` input (a per-request flag such as ``vad_filter``)."""
    tensor = grpcclient.InferInput(name, [1, 1], "BOOL")
    tensor.set_data_from_numpy(np.array([[value]], dtype=bool))
    return tensor


def bytes_request(pb, model: str, name: str, values: list[bytes], output: str):
    """A ``ModelInferRequest`` of one BYTES input ``[len(values), 1]`` (Triton's raw form: each
    element its 4-byte little-endian length, then its bytes) asking for ``output``."""
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = name, "BYTES"
    tensor.shape.extend((len(values), 1))
    request.outputs.add().name = output
    request.raw_input_contents.append(b"".join(len(v).to_bytes(4, "little") + v for v in values))
    return request


def fp32_output(response, name: str) -> np.ndarray:
    """The FP32 output ``name`` of a ``ModelInferResponse`` (Triton sends outputs raw)."""
    for index, tensor in enumerate(response.outputs):
        if tensor.name == name:
            if tensor.datatype != "FP32" or index >= len(response.raw_output_contents):
                raise proto.internal(f"the model's output '{name}' is {tensor.datatype}, not raw FP32")
            return np.frombuffer(response.raw_output_contents[index], dtype="<f4").reshape(tuple(tensor.shape))
    raise proto.internal(f"the model's response has no output '{name}'")
