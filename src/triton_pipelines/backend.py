"""Helpers for the thin ``model.py`` adapters; imported only inside the Python-backend stub."""

from __future__ import annotations

import json

from .errors import InputError


def error_response(error: Exception):
    """One request's error response: a bad input is INVALID_ARG (HTTP 400 / gRPC INVALID_ARGUMENT),
    anything else INTERNAL (500). The other requests of the batch are answered normally."""
    import triton_python_backend_utils as pb_utils

    code = pb_utils.TritonError.INVALID_ARG if isinstance(error, InputError) else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), code))


def model_parameters(args: dict) -> dict[str, str]:
    """The ``parameters`` of the model's config as plain strings."""
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
