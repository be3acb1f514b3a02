"""Shared helpers of the router's server tests."""

from __future__ import annotations

import json
import re
import urllib.request

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
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        return response.read().decode()


LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    total = 0.0
    for line in text.splitlines():
        match = LINE.match(line)
        if not match or match["name"] != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match["value"])
    return total
