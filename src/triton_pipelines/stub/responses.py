"""Requests in, responses out: the loop every ``model.py`` adapter runs, and the one mapping from
a failure to Triton's error codes.

A bad request (``InputError``) is answered alone with INVALID_ARG (HTTP 400 / gRPC
INVALID_ARGUMENT), its message prefixed by ``INPUT_ERROR_PREFIX``; the other requests of the same
``execute`` are answered normally. Anything else is INTERNAL (500), or UNAVAILABLE (503) for the
router's "not now" reasons (``errors.error_kind``)."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_pipelines.errors import INPUT_ERROR_PREFIX, InputError, RequestCancelled, error_kind
from triton_pipelines.stub import tracing


Outputs = Mapping[str, np.ndarray]  # output name → array (the request's rows)


def response_error(reason: str, message: str):
    """A ``pb_utils.TritonError`` for a failure reason (``errors.error_kind``): bad input →
    INVALID_ARG, not now → UNAVAILABLE, else INTERNAL."""
    codes = {"invalid_input": pb_utils.TritonError.INVALID_ARG, "unavailable": pb_utils.TritonError.UNAVAILABLE,
             "internal": pb_utils.TritonError.INTERNAL}
    return pb_utils.TritonError(message, codes[error_kind(reason)])


def error_response(error: Exception):
    """One request's error response: a bad input is INVALID_ARG with the message prefixed by
    ``INPUT_ERROR_PREFIX``, a request whose client has gone CANCELLED, anything else INTERNAL."""
    if isinstance(error, InputError):
        return pb_utils.InferenceResponse(error=response_error("invalid_input", INPUT_ERROR_PREFIX + str(error)))
    if isinstance(error, RequestCancelled):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), pb_utils.TritonError.CANCELLED))
    return pb_utils.InferenceResponse(error=response_error("internal", str(error)))


def output_response(outputs: Outputs):
    return pb_utils.InferenceResponse([pb_utils.Tensor(name, array) for name, array in outputs.items()])


def input_array(request, name: str) -> np.ndarray | None:
    """An input of the request as numpy; None for an optional input the request does not carry."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def request_parameters(request) -> dict[str, Any]:
    """The request's parameters (ensembles pass theirs on to every step)."""
    return json.loads(request.parameters() or "{}")


def respond(requests: Sequence, parse: Callable[[Any], Any],
            run: Callable[[list], Sequence[Outputs | Exception]] | None = None, failure: str = "") -> list:
    """One response per request, in order.

    ``parse(request)`` reads and checks one request; an ``InputError`` answers that request alone.
    Without ``run`` it returns the request's outputs. With ``run`` it returns the request's work,
    and ``run(works)`` does the work of every parsed request together (one batch), returning per
    work its outputs or the exception that fails that request alone; an exception raised by
    ``run`` fails every one of them (message prefixed by ``failure``), not the stub."""
    traced = tracing.begin(requests)  # None unless tracing: a span per traced request (stub/tracing.py)
    responses: list = []
    try:
        responses = _respond(requests, parse, run, failure)
        return responses
    finally:
        if traced is not None:
            traced.end(responses)


def _respond(requests: Sequence, parse, run, failure: str) -> list:
    responses: list = [None] * len(requests)
    parsed = {}
    for index, request in enumerate(requests):
        try:
            parsed[index] = parse(request)
        except InputError as error:
            responses[index] = error_response(error)
    results = parsed
    if run is not None and parsed:
        try:
            results = dict(zip(parsed, run(list(parsed.values()))))
        except Exception as error:  # a failed batch fails its requests, not the stub
            failed = RuntimeError(f"{failure}: {error}") if failure else error
            results = {index: failed for index in parsed}
    for index, result in results.items():
        responses[index] = error_response(result) if isinstance(result, Exception) else output_response(result)
    return responses
