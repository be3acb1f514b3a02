"""A gateway request refused before the gateway is called (by its key or by a limit of its key)."""

from __future__ import annotations

import math

from triton_pipelines.errors import REFUSAL_STATUSES, refusal_text


class GatewayRefusal(Exception):
    """A request refused before the gateway is called: by its key (missing or unknown: 401; a
    model it may not use: 403) or by a limit of its key (budget, rpm, tpm: 429).

    ``reason`` is the metric label (``unauthenticated``, ``model_not_allowed``, ``over_budget``,
    ``rate_limited``), ``limit`` the key's limit that refused (``budget``, ``rpm``, ``tpm``). Each
    transport maps it once: gRPC by ``errors.REFUSAL_STATUSES``, /v1 by ``openai_api.protocol.REFUSALS``."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float | None = None,
                 limit: str = ""):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message
        self.grpc_code = REFUSAL_STATUSES[status]
        self.retry_after_s = None if retry_after_s is None else float(max(1, math.ceil(retry_after_s)))
        self.limit = limit

    def marked(self) -> str:
        """The message with the marker the request screen turns into this status (errors.py)."""
        return refusal_text(self.status, self.message, self.retry_after_s)
