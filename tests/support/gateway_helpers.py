"""Helpers of the gateway's server tests (keys, budgets, fallbacks through the public ports)."""

from __future__ import annotations

import http.client
import json
import shutil
from pathlib import Path

import numpy as np
import yaml

from tests.conftest import environment  # noqa: F401  (the gateway tests' servers take it from here)
from tests.support.paths import PROJECT_ROOT

ROOT = PROJECT_ROOT


def router_repository(source: Path, target: Path, gateway: dict | None = None) -> Path:
    """A repository with only the built ``router``, its route file's gateway settings overridden."""
    shutil.copytree(source / "router", target / "router", ignore=shutil.ignore_patterns("splits.json"))
    shutil.copy2(source / ".built", target / ".built")
    routes = target / "router" / "1" / "routes.yaml"
    document = yaml.safe_load(routes.read_text())
    document["gateway"].update(gateway or {})
    routes.write_text(yaml.safe_dump(document))
    return target


def http_route(address: str, task: str, payload: dict, secret: str | None = None,
               parameters: dict | None = None, timeout_s: float = 60) -> tuple[int, dict, dict]:
    """(status, headers (lower-case), body JSON) of one router request over HTTP JSON; ``result``
    decoded into ``body["result"]`` on success."""
    host, port = address.rsplit(":", 1)
    request = {"inputs": [
        {"name": "task", "shape": [1, 1], "datatype": "BYTES", "data": [task]},
        {"name": "payload", "shape": [1, 1], "datatype": "BYTES", "data": [json.dumps(payload)]}]}
    if parameters:
        request["parameters"] = parameters
    headers = {"Content-Type": "application/json"}
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("POST", "/v2/models/router/infer", json.dumps(request), headers)
        response = connection.getresponse()
        body = json.loads(response.read() or b"{}")
        answer = {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()
    if response.status == 200:
        body["result"] = json.loads(body["outputs"][0]["data"][0])
    return response.status, answer, body


def grpc_route(address: str, task: str, payload: dict, secret: str | None = None):
    """One router request over gRPC: (result dict or None, the error or None)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(address)
    tensors = []
    for name, value in (("task", task), ("payload", json.dumps(payload))):
        tensor = grpcclient.InferInput(name, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[value.encode()]], dtype=object))
        tensors.append(tensor)
    try:
        result = client.infer("router", tensors, headers={"authorization": f"Bearer {secret}"} if secret else None)
        return json.loads(result.as_numpy("result")[0, 0]), None
    except InferenceServerException as error:
        return None, error
    finally:
        client.close()
