"""Shared helpers of the router's server tests."""

from __future__ import annotations

import json

from triton_pipelines import prometheus_text
from triton_pipelines.client import TritonClient, text_tensor


def route(client: TritonClient, task: str, payload, latency_class: str | None = None,
          request_id: str = "") -> dict:
    inputs = {"task": text_tensor([task]),
              "payload": text_tensor([payload if isinstance(payload, (str, bytes)) else json.dumps(payload)])}
    if latency_class is not None:
        inputs["latency_class"] = text_tensor([latency_class])
    result = client.infer("router", inputs, request_id=request_id)["result"]
    assert result.shape == (1, 1)
    return json.loads(result[0, 0])


def scrape(metrics_url: str) -> str:
    return prometheus_text.scrape(metrics_url)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    return prometheus_text.total(prometheus_text.parse_samples(text), name, **labels)
