"""Calling other models through BLS.

The router (``call_async``): outputs as numpy, failures as ``RouteError`` with a reason that says
whose fault it is (``errors.error_kind``). ``whisper_decode`` (``call``,
``gather_rows``): outputs kept as Triton tensors (on the gpu target they may live on the GPU and
are passed on as they are), failures as ``UpstreamError``."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_pipelines.errors import INPUT_ERROR_PREFIX, RouteError, UpstreamError
from triton_pipelines.stub.tracing import bls_span, bls_trace


# Messages of Triton's own refusals (2.51) that mean "not now" rather than "broken".
_UNAVAILABLE_MESSAGES = ("Exceeds maximum queue size", "Request timeout expired", "Server is stopping",
                         "has stopped accepting new inference requests")


def failure_reason(code, message: str, target: str) -> str:
    if f"Model '{target}' is not ready" in message or "unknown model" in message:
        return "not_loaded"
    if code == pb_utils.TritonError.INVALID_ARG or INPUT_ERROR_PREFIX in message:
        return "upstream_invalid_input"
    if code == pb_utils.TritonError.UNAVAILABLE or any(m in message for m in _UNAVAILABLE_MESSAGES):
        return "upstream_unavailable"
    return "upstream_error"


def bls_outputs(response, target: str, names: Sequence[str]) -> dict[str, np.ndarray]:
    if response.has_error():
        error = response.error()
        message = error.message()
        reason = failure_reason(error.code(), message, target)
        if reason == "not_loaded":
            raise RouteError(reason, f"model {target} is not loaded on this server (is its pipeline in the repository?)")
        raise RouteError(reason, f"model {target}: {message}")
    outputs = {}
    for name in names:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is None:
            raise RouteError("upstream_error", f"model {target} returned no output '{name}'")
        outputs[name] = tensor.as_numpy()
    return outputs


async def call_async(target: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str],
                     parameters: Mapping[str, str] | None = None) -> dict[str, np.ndarray]:
    """One request to ``target`` without blocking the caller's event loop (the router's calls);
    ``parameters``: the request's parameters."""
    trace = bls_trace()  # the request's trace, when traced: Triton's spans of the callee join it
    kwargs = {"parameters": dict(parameters)} if parameters else {}
    if trace is not None:
        kwargs["trace"] = trace
    request = pb_utils.InferenceRequest(model_name=target, requested_output_names=list(outputs),
                                        inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()],
                                        **kwargs)
    with bls_span(target):
        try:
            response = await request.async_exec()
        except pb_utils.TritonModelException as error:
            raise RouteError("upstream_error", f"model {target}: {error}") from None
        return bls_outputs(response, target, outputs)


def call(model: str, inputs: Sequence, outputs: Sequence[str], cpu_outputs: bool = False,
         parameters: Mapping[str, str] | None = None) -> dict:
    """One blocking request → its output tensors by name. ``cpu_outputs``: ask for them in CPU
    memory; ``parameters``: the request's parameters."""
    kwargs = {"parameters": dict(parameters)} if parameters else {}
    if cpu_outputs:
        kwargs["preferred_memory"] = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)
    trace = bls_trace()  # the request's trace, when traced (stub/tracing.py)
    if trace is not None:
        kwargs["trace"] = trace
    request = pb_utils.InferenceRequest(model_name=model, inputs=list(inputs), requested_output_names=list(outputs),
                                        **kwargs)
    with bls_span(model):
        response = request.exec()
    if response.has_error():
        raise UpstreamError(f"{model} failed: {response.error().message()}")
    return {tensor.name(): tensor for tensor in response.output_tensors()}


def gather_rows(tensors: Mapping, rows) -> dict:
    """The given rows of CPU tensors, as new tensors of the same names."""
    return {name: pb_utils.Tensor(name, np.ascontiguousarray(tensor.as_numpy()[rows])) for name, tensor in tensors.items()}
