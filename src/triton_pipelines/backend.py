"""Helpers for the thin ``model.py`` adapters; imported only inside the Python-backend stub."""

from __future__ import annotations

import json

from .errors import INPUT_ERROR_PREFIX, InputError
from .router_service import error_kind


def response_error(reason: str, message: str):
    """A ``pb_utils.TritonError`` for a failure reason (``router_service.error_kind``): bad input →
    INVALID_ARG (HTTP 400 / gRPC INVALID_ARGUMENT), not now → UNAVAILABLE (503), else INTERNAL (500)."""
    import triton_python_backend_utils as pb_utils

    codes = {"invalid_input": pb_utils.TritonError.INVALID_ARG, "unavailable": pb_utils.TritonError.UNAVAILABLE,
             "internal": pb_utils.TritonError.INTERNAL}
    return pb_utils.TritonError(message, codes[error_kind(reason)])


def error_response(error: Exception):
    """One request's error response: a bad input is INVALID_ARG with the message prefixed by
    ``INPUT_ERROR_PREFIX``, anything else INTERNAL (500). The other requests of the batch are
    answered normally."""
    import triton_python_backend_utils as pb_utils

    if isinstance(error, InputError):
        return pb_utils.InferenceResponse(error=response_error("invalid_input", INPUT_ERROR_PREFIX + str(error)))
    return pb_utils.InferenceResponse(error=response_error("internal", str(error)))


def model_parameters(args: dict) -> dict[str, str]:
    """The ``parameters`` of the model's config as plain strings."""
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
