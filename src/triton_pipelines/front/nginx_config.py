"""The public front of the server: nginx in front of ``tritonserver`` on both run modes.

Why a proxy: ``tritonserver`` 2.51 parses an HTTP request's JSON with a recursive parser on a
thread stack and has no option that bounds it. A JSON body of about 4 MiB, or one nested about
104,000 deep (208 KB), kills the whole server with SIGSEGV. Nothing but a proxy can refuse such a
request before Triton reads it. Triton itself listens on loopback only; nginx owns the public ports
and enforces, before anything is copied into Triton:

- HTTP: ``/v2/models/<m>/infer`` bodies at most ``max_body_bytes``; the JSON part of a request
  (the whole body, or the ``Inference-Header-Content-Length`` bytes of a binary request) at most
  ``max_json_bytes``; no ``Content-Encoding`` (a compressed body could inflate past both limits).
  Over a limit: 413 with a JSON error that names the limit and the remedy.
- gRPC (HTTP/2): every message at most ``max_body_bytes``; over it, ``RESOURCE_EXHAUSTED``.
- Inference requests in flight: at most ``max_inflight`` on each public port; one more is refused
  at once with 503 (``Retry-After: 1``) / ``UNAVAILABLE``. HTTP requests (native and ``/v1``) are
  counted here once nginx has their whole body (a "gate" server after the public one, on a Unix
  socket: ``gate_socket``), so slow senders hold no place. gRPC requests are counted in the request screens (``places.py``),
  once each message has arrived, one place per request of a ``ModelStreamInfer`` stream: nginx
  would count a stream from its HEADERS frame, with or without requests in it. nginx passes the
  client's address to the screen (``CLIENT_ADDRESS_HEADER``) for its share.
- Inference requests go to each replica's request screen (``screen_server.py``), which reads the
  body nginx cannot (crashers inside the size limits, non-public models); the rest goes to Triton.
- One client (its address) holds at most ``max_inflight_per_client`` of those places (and as many
  gRPC inference streams, counted here), and one HTTP/2 connection at most 128 streams; the request
  line and each header at most 8 KiB. A ``ModelStreamInfer`` stream may stay open without traffic
  for the upstream timeout (a client waits there for its responses with its request side open); the
  screen closes one that sends no request within ``limits.STREAM_FIRST_MESSAGE_S``.
- Only the public APIs pass (health, metadata, config, statistics, inference). The model-repository,
  shared-memory, logging and trace APIs answer 403 / ``PERMISSION_DENIED`` here on both protocols;
  they are also restricted with a key inside Triton (``control.py``), reachable on loopback only.
- Metrics (``/metrics`` on the metrics port) and readiness come from the launcher's status server,
  which adds its own counters and sees dead Python stubs (``server/status.py``).

The configuration is the template ``templates/nginx.conf`` (``%%name`` fields, see ``NginxTemplate``)
rendered by ``render_config`` from a ``ProxyConfig``, with every answer's text in ``MESSAGES``;
``tests/unit/front/test_nginx_config.py`` pins the rendered text. Running nginx on it (``nginx -t``
before it starts or reloads, the foreground child the launcher restarts if it dies) is
``server/nginx_process.py``'s job.
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass
from pathlib import Path

from triton_pipelines.errors import OPENAI_METHOD_NOT_ALLOWED, OPENAI_NOT_FOUND, ConfigError, openai_error_body
from triton_pipelines.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_JSON_BYTES, REQUEST_TIMEOUT_S


# Public HTTP endpoints (KServe v2 + Triton's statistics/config extensions). Anything else is 404,
# the control APIs 403.
# Model names are at most 256 characters (ours are short); longer URLs never reach Triton.
_MODEL = r"/v2/models/[^/]{1,256}(/versions/[0-9]{1,19})?"
CONTROL_HTTP_PATTERN = (r"^/v2/(repository|systemsharedmemory|cudasharedmemory|logging|trace)(/|$)"
                        r"|^/v2/models/[^/]+(/versions/[0-9]+)?/trace/")
# gRPC methods that pass to Triton; ModelInfer and ModelStreamInfer (decoupled models: their body
# limit applies to the whole stream) go through the screen; every other GRPCInferenceService method
# is a control API.
PUBLIC_GRPC_METHODS = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
                       "ModelInfer", "ModelConfig", "ModelStatistics")
GRPC_SERVICE = "inference.GRPCInferenceService"
# gRPC status codes
GRPC_PERMISSION_DENIED = 7
GRPC_RESOURCE_EXHAUSTED = 8
GRPC_UNIMPLEMENTED = 12
GRPC_UNAVAILABLE = 14
# nginx's buffers for the request line and each header: longer ones are refused with 400.
HEADER_BUFFER_KB = 8
# The gRPC metadata in which nginx tells the screen the client's address (its share of the places);
# set by nginx whatever the client sent, dropped by the screen before Triton.
CLIENT_ADDRESS_HEADER = "x-triton-pipelines-client"


def regex_at_most(limit: int) -> str:
    """A regular expression matching the decimal numbers 0..``limit`` (leading zeros allowed):
    nginx ``map`` cannot compare numbers, so the JSON-header limit is a pattern."""
    digits = str(limit)
    branches = [rf"[0-9]{{1,{len(digits) - 1}}}"] if len(digits) > 1 else []
    for i, digit in enumerate(digits):  # same prefix, a smaller digit here, anything after
        if digit != "0":
            rest = len(digits) - i - 1
            smaller = "0" if digit == "1" else f"[0-{int(digit) - 1}]"
            branches.append(digits[:i] + smaller + (f"[0-9]{{{rest}}}" if rest else ""))
    branches.append(digits)
    return "^0*(" + "|".join(branches) + ")$"


@dataclass(frozen=True)
class ProxyConfig:
    listen_address: str
    http_port: int
    grpc_port: int
    metrics_port: int
    # tritonserver's loopback ports, one per replica in service (round robin between them)
    triton_http_ports: tuple[int, ...]
    triton_grpc_ports: tuple[int, ...]
    # The request screen of each of those replicas (screen_server.py): inference goes through it.
    screen_http_ports: tuple[int, ...]
    screen_grpc_ports: tuple[int, ...]
    status_port: int  # the launcher's status server: /metrics and /v2/health/*
    state_dir: Path  # pid file, temp bodies
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    # One client's share of max_inflight (its address; 0: no share), so one greedy client is refused
    # before its neighbours are. Behind a proxy or NAT every client has the proxy's address: raise it.
    max_inflight_per_client: int = 0
    workers: int = 1
    upstream_timeout_s: int = int(REQUEST_TIMEOUT_S)
    run_as: str | None = None  # the worker user when nginx starts as root
    # The OpenAI-compatible frontend (openai_api/) that /v1/ goes to; 0: none (/v1 answers 503).
    openai_port: int = 0


def default_worker_user() -> str | None:
    """Who nginx's workers run as: nobody when started as root (nginx switches only then)."""
    return "nobody nogroup" if os.geteuid() == 0 else None


# What the front answers, one entry per refusal: str.format fields from ``_message_values``. HTTP
# answers carry them as {"error": ...} (Triton's own shape), gRPC ones as grpc-message.
BINARY_HINT = ("send tensor data in binary form (tritonclient: binary_data=True, the default for "
               "set_data_from_numpy; raw HTTP: the Inference-Header-Content-Length extension) or use gRPC")
MESSAGES = {
    "too_large": "request body exceeds the server's limit of {max_body_bytes} bytes ({body_mb})",
    "json_too_large": "the JSON part of a request is limited to {max_json_bytes} bytes ({json_kb}): {binary_hint}",
    "bad_header_length": "Inference-Header-Content-Length must be a decimal number of bytes: the length of "
                         "the JSON part of the request",
    # a request line or header nginx itself cannot parse (a %00 in the path, a bad method token)
    "bad_request": "the request is malformed (its request line or a header cannot be parsed)",
    "encoding": "compressed request bodies (Content-Encoding) are not accepted: send the body uncompressed",
    "grpc_encoding": "compressed gRPC messages (grpc-encoding) are not accepted: send them uncompressed",
    "header_too_large": "a request header is longer than {header_buffer_kb} KiB",
    "control": "this API is not available on the public port: the model-repository, shared-memory, "
               "logging and trace APIs are restricted to the server's own host",
    "not_found": "not found",
    "method": "method not allowed",
    "unavailable": "the inference server is starting or restarting: retry shortly",
    # /v1 has its own process: when it is down, say so (the native /v2 API is not affected)
    "openai_unavailable": "the OpenAI-compatible /v1 frontend is starting or restarting: retry shortly "
                          "(the native /v2 API is not affected; GET /v1/health tells when /v1 is back)",
    "overloaded": "the server is at its limit of {max_inflight} inference requests in flight: retry shortly",
    # gRPC has one overload answer for both counts (HTTP tells them apart, below)
    "grpc_overloaded": "the server is at its limit of {max_inflight} inference requests in flight: retry shortly",
    "grpc_overloaded_per_client": "the server is at its limit of {max_inflight} inference requests in flight, "
                                  "or this client (its address) at its share of {max_inflight_per_client}: "
                                  "retry shortly",
    "client_overloaded": "this client (its address) is at its limit of {max_inflight_per_client} "
                         "inference requests in flight: retry shortly",
    "grpc_unknown_method": "unknown gRPC method",
    # /v1 paths and methods the frontend does not have, stopped here (its own answers, the same)
    "openai_not_found": OPENAI_NOT_FOUND[0],
    "openai_method": OPENAI_METHOD_NOT_ALLOWED[0],
}
# The HTTP answers the template holds as nginx string literals (%%json_<key>).
HTTP_MESSAGES = ("too_large", "json_too_large", "bad_header_length", "bad_request", "encoding", "header_too_large",
                 "control", "not_found", "method", "unavailable", "overloaded", "client_overloaded")


class NginxTemplate(string.Template):
    """``string.Template`` with ``%%`` as its delimiter (``%%name``, ``%%{name}``): nginx's own
    variables are written ``$name``, and ``%%`` appears nowhere in an nginx configuration."""

    delimiter = "%%"


# The configuration text: templates/nginx.conf, shipped with the package (pyproject package-data).
TEMPLATE = Path(__file__).parent / "templates" / "nginx.conf"


def _json_error(message: str) -> str:
    """An nginx string literal holding ``{"error": message}`` (Triton's own error shape)."""
    return "'" + json.dumps({"error": message}).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _message_values(config: ProxyConfig) -> dict[str, object]:
    return {"max_body_bytes": config.max_body_bytes, "body_mb": f"{config.max_body_bytes / 2**20:g} MiB",
            "max_json_bytes": config.max_json_bytes, "json_kb": f"{config.max_json_bytes // 1024} KiB",
            "binary_hint": BINARY_HINT, "header_buffer_kb": HEADER_BUFFER_KB, "max_inflight": config.max_inflight,
            "max_inflight_per_client": config.max_inflight_per_client,
            "method": "$request_method"}  # nginx's method token: capitals, '_' and '-' (nothing to escape)


def grpc_overloaded_message(max_inflight: int, max_inflight_per_client: int) -> str:
    """The gRPC port's overload answer (the request screens give it): the server's limit, and the
    client's share when there is one."""
    key = "grpc_overloaded_per_client" if max_inflight_per_client else "grpc_overloaded"
    return MESSAGES[key].format(max_inflight=max_inflight, max_inflight_per_client=max_inflight_per_client)


def messages(config: ProxyConfig) -> dict[str, str]:
    """``MESSAGES`` for ``config``'s limits; ``grpc_overloaded`` names the client's share when there is one."""
    values = _message_values(config)
    texts = {key: text.format(**values) for key, text in MESSAGES.items()}
    texts["grpc_overloaded"] = grpc_overloaded_message(config.max_inflight, config.max_inflight_per_client)
    return texts


# /v1 answers in OpenAI's error shape: key → (message key in MESSAGES, OpenAI type, code).
OPENAI_ERRORS = {"too_large": ("too_large", "invalid_request_error", "request_too_large"),
                 "client_overloaded": ("client_overloaded", "rate_limit_error", "rate_limit_exceeded"),
                 "overloaded": ("overloaded", "rate_limit_error", "rate_limit_exceeded"),
                 "unavailable": ("openai_unavailable", "server_error", "service_unavailable"),
                 "not_found": ("openai_not_found", "invalid_request_error", OPENAI_NOT_FOUND[1]),
                 "method": ("openai_method", "invalid_request_error", OPENAI_METHOD_NOT_ALLOWED[1]),
                 "bad_request": ("bad_request", "invalid_request_error", "bad_request")}


def _openai_error(message: str, kind: str, code: str) -> str:
    """An nginx string literal holding OpenAI's error shape."""
    body = json.dumps(openai_error_body(message, kind, code))
    return "'" + body.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _servers(ports: tuple[int, ...]) -> str:
    # A replica that refuses a connection (restarting, retired) is skipped for the next one:
    # nginx retries only what it has not sent (POST is not idempotent).
    return "\n".join(f"        server 127.0.0.1:{port} max_fails=0;" for port in ports)


# The in-flight gate: HTTP inference requests reach it with their whole body read, so a client that
# sends its body slowly cannot hold one of the max_inflight places. It is this nginx, on a Unix socket
# in the workers' temp folder: no TCP port to take or leave in TIME_WAIT per request, and no other
# local user reaches it past the public server's checks. (No kept-alive connections to it: at a
# reload, a new worker's idle connection accepted by an old worker was closed as that one exited,
# and the next POST on it failed.)
GATE_SOCKET = "gate.sock"
MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path, less its terminating NUL


def gate_socket(temp_dir: Path) -> Path:
    """The gate's socket in the workers' temp folder (``temp_dir``); a ConfigError naming the folder
    when its path is too long for a Unix socket."""
    path = temp_dir.resolve() / GATE_SOCKET
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError(f"the state folder {temp_dir} is too long a path for nginx's gate socket "
                          f"({len(os.fsencode(path))} bytes with /{GATE_SOCKET}, at most {MAX_SOCKET_PATH}): "
                          "choose a shorter --state-dir")
    return path


def render_config(config: ProxyConfig, temp_dir: Path | None = None) -> str:
    """nginx.conf for the public ports (see the module docstring) from templates/nginx.conf; the
    workers' temp folders (large request bodies) under ``temp_dir``, by default the state folder."""
    address = config.listen_address
    if ":" in address and not address.startswith("["):
        address = f"[{address}]"
    texts = messages(config)
    per_client = config.max_inflight_per_client
    values = {
        **texts,
        **{f"json_{key}": _json_error(texts[key]) for key in HTTP_MESSAGES},
        "user_line": f"user {config.run_as};\n" if config.run_as else "",
        "workers": config.workers,
        "state": config.state_dir.resolve(),
        "temp": (temp_dir or config.state_dir).resolve(),
        "header_buffer_kb": HEADER_BUFFER_KB,
        "json_header_length_pattern": regex_at_most(config.max_json_bytes),
        "triton_http_servers": _servers(config.triton_http_ports),
        "triton_grpc_servers": _servers(config.triton_grpc_ports),
        "screen_http_servers": _servers(config.screen_http_ports),
        "screen_grpc_servers": _servers(config.screen_grpc_ports),
        **{f"openai_error_{key}": _openai_error(texts[message], kind, code)
           for key, (message, kind, code) in OPENAI_ERRORS.items()},
        "openai_servers": _servers((config.openai_port,)) if config.openai_port
        else "        server 127.0.0.1:1 down;",
        "gate_socket": gate_socket(temp_dir or config.state_dir),
        "status_port": config.status_port,
        "upstream_timeout_s": config.upstream_timeout_s,
        "address": address,
        "http_port": config.http_port,
        "grpc_port": config.grpc_port,
        "metrics_port": config.metrics_port,
        "max_body_bytes": config.max_body_bytes,
        "max_json_bytes": config.max_json_bytes,
        "max_inflight": config.max_inflight,
        # One client's in-flight count, by its address: counted from its headers (a client that sends
        # its body slowly holds only its own places), before the server's count in the gate.
        "client_limit": f"limit_conn perclient {per_client};" if per_client else "",
        "model_path": _MODEL,
        "control_http_pattern": CONTROL_HTTP_PATTERN,
        "grpc_service": GRPC_SERVICE,
        "grpc_service_pattern": GRPC_SERVICE.replace(".", "\\."),
        "public_grpc_methods": "|".join(PUBLIC_GRPC_METHODS),
        "grpc_permission_denied": GRPC_PERMISSION_DENIED,
        "grpc_resource_exhausted": GRPC_RESOURCE_EXHAUSTED,
        "grpc_unimplemented": GRPC_UNIMPLEMENTED,
        "grpc_unavailable": GRPC_UNAVAILABLE,
        "client_address_header": CLIENT_ADDRESS_HEADER,
    }
    return NginxTemplate(TEMPLATE.read_text()).substitute(values)
