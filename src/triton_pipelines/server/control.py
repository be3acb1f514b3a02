"""Triton's control APIs (model repository, shared memory, logging, trace), kept behind a key.

``tritonserver`` runs with ``--http-restricted-api`` / ``--grpc-restricted-protocol`` for those APIs:
a request must carry the header ``triton-control-key: <key>``. The key comes from
``TRITON_CONTROL_KEY``; when that is unset the launcher generates one at start. Either way it is
written to ``<state dir>/control.key`` (mode 0600) with the loopback address of Triton's own HTTP
port in ``<state dir>/server.json`` (``server/state.py``), so our tools (drain, watchdog, rollout,
benchmarks, tests) find both. The public ports (nginx, ``front/nginx_config.py``) refuse these APIs whatever the key.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable

from triton_pipelines.server.state import STATE_ENV, ServerState, read_key, resolve_state_dir  # noqa: F401 (STATE_ENV: rollout.py)

CONTROL_HEADER = "triton-control-key"
KEY_ENV = "TRITON_CONTROL_KEY"
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
# tritonserver parses "<apis>:<header>=<key>": the key may not hold ':', ',' or '='.
KEY_PATTERN = re.compile(r"^[A-Za-z0-9._~+/-]{16,256}$")


def resolve_key(environ=os.environ) -> str:
    key = environ.get(KEY_ENV, "").strip()
    if not key:
        return secrets.token_urlsafe(32)
    if not KEY_PATTERN.match(key):
        raise ValueError(f"{KEY_ENV} must be 16 to 256 characters of A-Z a-z 0-9 . _ ~ + / -")
    return key


def restricted_api_flags(key: str) -> list[str]:
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{CONTROL_HEADER}={key}",
            f"--grpc-restricted-protocol={apis}:{CONTROL_HEADER}={key}"]


class ControlError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class ControlClient:
    """The model-repository API on Triton's loopback HTTP port, with the control key."""

    def __init__(self, http_url: str, key: str, timeout_s: float = 30.0):
        self.http_url = http_url  # host:port
        self.key = key
        self.timeout_s = timeout_s

    @classmethod
    def from_state(cls, directory: Path | str | None = None) -> "ControlClient":
        """The running launcher's control endpoint (``--state-dir``, ``$TRITON_STATE_DIR`` or the
        default ``.triton/<http port 8000>``: ``server_state.resolve_state_dir``)."""
        try:
            return cls(ServerState.read(directory).triton_http, read_key(directory))
        except FileNotFoundError:
            raise RuntimeError(f"no running launcher found in {resolve_state_dir(directory)} "
                               f"(pass --state-dir or set {STATE_ENV})") from None

    def request(self, path: str, body: dict | None = None, method: str | None = None,
                timeout_s: float | None = None) -> dict | list:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=data,
                                         method=method or ("POST" if data is not None else "GET"),
                                         headers={CONTROL_HEADER: self.key, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("error", detail)
            except ValueError:
                pass
            raise ControlError(error.code, detail) from None
        return json.loads(payload) if payload else {}

    def index(self, ready_only: bool = False) -> list[dict]:
        return self.request("/v2/repository/index", {"ready": ready_only})  # type: ignore[return-value]

    def states(self) -> dict[str, str]:
        """Model name → state of its loaded (or last) version: READY, UNAVAILABLE, LOADING, ..."""
        found: dict[str, str] = {}
        for entry in self.index():
            if entry.get("state") == "READY" or entry["name"] not in found:
                found[entry["name"]] = entry.get("state", "")
        return found

    def config(self, name: str) -> dict:
        return self.request(f"/v2/models/{name}/config")  # type: ignore[return-value]

    def load(self, name: str, config: dict | None = None, timeout_s: float = 600) -> None:
        body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
        self.request(f"/v2/repository/models/{name}/load", body, timeout_s=timeout_s)

    def unload(self, name: str, unload_dependents: bool = False) -> None:
        body = {"parameters": {"unload_dependents": True}} if unload_dependents else {}
        self.request(f"/v2/repository/models/{name}/unload", body)

    def wait_unloaded(self, names: Iterable[str], deadline: float, poll_s: float = 0.1) -> set[str]:
        """Wait until none of ``names`` is loaded, loading or unloading; returns those still pending."""
        pending = set(names)
        while pending and time.monotonic() < deadline:
            states = self.states()
            pending = {n for n in pending if states.get(n) in ("READY", "UNLOADING", "LOADING")}
            if pending:
                time.sleep(poll_s)
        return pending
