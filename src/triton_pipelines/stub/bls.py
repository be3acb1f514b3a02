"""BLS responses as plain results: outputs as numpy, failures as ``RouteError`` with a reason that
says whose fault it is (``router_service.error_kind``)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

from ..errors import INPUT_ERROR_PREFIX
from ..routing import RouteError

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
