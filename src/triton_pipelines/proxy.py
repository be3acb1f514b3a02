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
- Inference requests in flight, both ports together: at most ``max_inflight``; one more is refused
  at once with 503 (``Retry-After: 1``) / ``UNAVAILABLE``. HTTP requests are counted once nginx has
  their whole body (a loopback "gate" server after the public one), so slow senders hold no place;
  a gRPC request is counted from its headers (its message streams through to Triton).
- Inference requests go to each replica's request screen (``screen_server.py``), which reads the
  body nginx cannot (crashers inside the size limits, non-public models); the rest goes to Triton.
- One client (its address) holds at most ``max_inflight_per_client`` of those places, and one
  HTTP/2 connection at most 128 streams; the request line and each header at most 8 KiB.
- Only the public APIs pass (health, metadata, config, statistics, inference). The model-repository,
  shared-memory, logging and trace APIs answer 403 / ``PERMISSION_DENIED`` here on both protocols;
  they are also restricted with a key inside Triton (``control.py``), reachable on loopback only.
- Metrics (``/metrics`` on the metrics port) and readiness come from the launcher's status server,
  which adds its own counters and sees dead Python stubs (``supervisor.py``).

The configuration is generated (``render_config``) and unit-tested; nginx runs in the foreground
as a child of the launcher, which restarts it if it dies.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .processes import child_pids, spawn

# The JSON part of an HTTP request: Triton 2.51 crashes at ~4 MiB of flat JSON and at a nesting
# depth of ~104,000 (~208 KB). 128 KiB can nest at most 65,536 deep; anything larger goes binary.
DEFAULT_MAX_JSON_BYTES = 128 * 1024
# A whole request, binary tensors included (the largest legal input is a 64 MiB audio file).
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
# Inference requests in flight through both public ports together (every replica behind them):
# the back-pressure of the whole server. The models have no queue policy (a Triton 2.51 policy
# stalls its batcher, build/repo_builder/compute.py), so this bounds every queue behind the front.
DEFAULT_MAX_INFLIGHT = 256

# Public HTTP endpoints (KServe v2 + Triton's statistics/config extensions). Anything else is 404,
# the control APIs 403.
# Model names are at most 256 characters (ours are short); longer URLs never reach Triton.
_MODEL = r"/v2/models/[^/]{1,256}(/versions/[0-9]{1,19})?"
CONTROL_HTTP_PATTERN = (r"^/v2/(repository|systemsharedmemory|cudasharedmemory|logging|trace)(/|$)"
                        r"|^/v2/models/[^/]+(/versions/[0-9]+)?/trace/")
# gRPC methods that pass; every other GRPCInferenceService method is a control API (or streaming,
# which our non-decoupled models do not need and whose body limit would apply to the whole stream).
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


def nginx_binary() -> str:
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                           if os.access(p, os.X_OK)), None)
    if found is None:
        raise RuntimeError("nginx is not installed: `make install` installs it (Debian package nginx-core); "
                           "the container image has it")
    return found


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
    # Loopback port of the in-flight gate: HTTP inference requests reach it with their whole body
    # read, so a client that sends its body slowly cannot hold one of the max_inflight places.
    gate_port: int
    state_dir: Path  # pid file, temp bodies
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    # One client's share of max_inflight (its address; 0: no share), so one greedy client is refused
    # before its neighbours are. Behind a proxy or NAT every client has the proxy's address: raise it.
    max_inflight_per_client: int = 0
    workers: int = 1
    # Long enough for the slowest legal request (300 s of audio at saturation).
    upstream_timeout_s: int = 300
    run_as: str | None = None  # the worker user when nginx starts as root


def default_worker_user() -> str | None:
    """Who nginx's workers run as: nobody when started as root (nginx switches only then)."""
    return "nobody nogroup" if os.geteuid() == 0 else None


def _json_error(message: str) -> str:
    """An nginx string literal holding ``{"error": message}`` (Triton's own error shape)."""
    return "'" + json.dumps({"error": message}).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _grpc_error_location(name: str, code: int, message: str) -> str:
    # A trailers-only gRPC answer: HTTP 200, grpc-status and grpc-message, no body.
    return (f"        location = /{name} {{\n            internal;\n            default_type application/grpc;\n"
            f"            add_header grpc-status {code} always;\n"
            f"            add_header grpc-message \"{message}\" always;\n            return 200 \"\";\n        }}\n")


def render_config(config: ProxyConfig, temp_dir: Path | None = None) -> str:
    """nginx.conf for the public ports (see the module docstring); the workers' temp folders (large
    request bodies) under ``temp_dir``, by default the state folder."""
    state = config.state_dir.resolve()
    temp = (temp_dir or config.state_dir).resolve()
    address = config.listen_address
    if ":" in address and not address.startswith("["):
        address = f"[{address}]"
    body_mb = f"{config.max_body_bytes / 2**20:g} MiB"
    json_kb = f"{config.max_json_bytes // 1024} KiB"
    binary_hint = ("send tensor data in binary form (tritonclient: binary_data=True, the default for "
                   "set_data_from_numpy; raw HTTP: the Inference-Header-Content-Length extension) or use gRPC")
    messages = {
        "too_large": f"request body exceeds the server's limit of {config.max_body_bytes} bytes ({body_mb})",
        "json_too_large": f"the JSON part of a request is limited to {config.max_json_bytes} bytes "
                          f"({json_kb}): {binary_hint}",
        "bad_header_length": "Inference-Header-Content-Length must be a decimal number of bytes, at most "
                             f"{config.max_json_bytes} ({json_kb}): {binary_hint}",
        "encoding": "compressed request bodies (Content-Encoding) are not accepted: send the body uncompressed",
        "grpc_encoding": "compressed gRPC messages (grpc-encoding) are not accepted: send them uncompressed",
        "header_too_large": f"a request header is longer than {HEADER_BUFFER_KB} KiB",
        "control": "this API is not available on the public port: the model-repository, shared-memory, "
                   "logging and trace APIs are restricted to the server's own host",
        "not_found": "not found",
        "method": "method not allowed",
        "unavailable": "the inference server is starting or restarting: retry shortly",
        "overloaded": f"the server is at its limit of {config.max_inflight} inference requests in flight: "
                      "retry shortly",
        "grpc_overloaded": f"the server is at its limit of {config.max_inflight} inference requests in flight"
                           + (f", or this client (its address) at its share of {config.max_inflight_per_client}"
                              if config.max_inflight_per_client else "") + ": retry shortly",
        "client_overloaded": f"this client (its address) is at its limit of {config.max_inflight_per_client} "
                             "inference requests in flight: retry shortly",
    }
    per_client = config.max_inflight_per_client
    # One client's in-flight count, by its address: counted from its headers (a client that sends
    # its body slowly holds only its own places), before the server's count in the gate.
    client_limit = f"limit_conn perclient {per_client};" if per_client else ""
    user_line = f"user {config.run_as};\n" if config.run_as else ""

    def servers(ports: tuple[int, ...]) -> str:
        # A replica that refuses a connection (restarting, retired) is skipped for the next one:
        # nginx retries only what it has not sent (POST is not idempotent).
        return "\n".join(f"        server 127.0.0.1:{port} max_fails=0;" for port in ports)
    lines = f"""# Generated by triton_pipelines.proxy: edit the generator, not this file.
{user_line}worker_processes {config.workers};
daemon off;
master_process on;
pid {state}/nginx.pid;
error_log stderr error;

events {{
    worker_connections 4096;
}}

http {{
    access_log off;
    server_tokens off;
    client_body_temp_path {temp}/client_body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;

    # Slow or idle clients are cut off instead of holding connections.
    client_header_timeout 15s;
    client_body_timeout 30s;
    send_timeout 60s;
    keepalive_timeout 75s;
    # Longer request lines and headers are refused here (Triton's HTTP server fails on them).
    large_client_header_buffers 4 {HEADER_BUFFER_KB}k;
    client_body_buffer_size 1m;
    default_type application/json;

    # 'json': the whole body is JSON; 'binary': the JSON header is within the limit; else refused.
    map $http_inference_header_content_length $infer_body {{
        "" json;
        "~^0+$" json;
        "~{regex_at_most(config.max_json_bytes)}" binary;
        default bad;
    }}
    # Back-pressure: one count of inference requests in flight for both public ports (an HTTP/2
    # stream counts as a connection, an idle keep-alive connection does not): in the HTTP gate and
    # at gRPC ModelInfer. Over the limit: 429 inside, answered as 503 / UNAVAILABLE (error pages).
    map $host $inflight_key {{
        default all;
    }}
    limit_conn_zone $inflight_key zone=inflight:1m;
    limit_conn_zone $binary_remote_addr zone=perclient:10m;
    limit_conn_status 429;
    limit_conn_log_level warn;  # below error_log's level: an overload does not flood the log
    map $http_content_encoding $encoding_ok {{
        "" 1;
        identity 1;
        default 0;
    }}
    map $http_grpc_encoding $grpc_encoding_ok {{
        "" 1;
        identity 1;
        default 0;
    }}

    upstream triton_http {{
{servers(config.triton_http_ports)}
        keepalive 64;
    }}
    upstream inflight_gate {{
        server 127.0.0.1:{config.gate_port};
        keepalive 64;
    }}
    upstream triton_grpc {{
{servers(config.triton_grpc_ports)}
        keepalive 64;
    }}
    upstream screen_http {{
{servers(config.screen_http_ports)}
        keepalive 64;
    }}
    upstream screen_grpc {{
{servers(config.screen_grpc_ports)}
        keepalive 64;
    }}
    upstream launcher_status {{
        server 127.0.0.1:{config.status_port};
        keepalive 4;
    }}

    proxy_http_version 1.1;
    proxy_set_header Connection "";
    # The control key never travels from a public client to Triton.
    proxy_set_header triton-control-key "";
    proxy_read_timeout {config.upstream_timeout_s}s;
    proxy_send_timeout {config.upstream_timeout_s}s;
    proxy_buffers 16 64k;

    # ---------------------------------------------------------------- HTTP ({config.http_port})
    server {{
        listen {address}:{config.http_port} backlog=4096;
        client_max_body_size {config.max_body_bytes};
        error_page 413 = @too_large;
        error_page 502 503 504 = @unavailable;
        error_page 494 = @header_too_large;
        error_page 429 = @client_overloaded;  # only this client's share is counted here

        if ($encoding_ok = 0) {{
            return 415 {_json_error(messages["encoding"])};
        }}

        # Inference goes through the gate (below) with its whole body read (proxy_request_buffering).
        location ~ "^{_MODEL}/infer$" {{
            if ($infer_body = bad) {{
                return 413 {_json_error(messages["bad_header_length"])};
            }}
            if ($infer_body = json) {{
                rewrite ^ /__json$uri last;
            }}
            {client_limit}
            proxy_pass http://inflight_gate;
        }}
        location ^~ /__json/ {{
            internal;
            client_max_body_size {config.max_json_bytes};
            # (error_page here replaces the server's: every one this location can meet again)
            error_page 413 = @json_too_large;
            error_page 429 = @client_overloaded;
            error_page 502 503 504 = @unavailable;
            rewrite ^/__json(/.*)$ $1 break;
            {client_limit}
            proxy_pass http://inflight_gate;
        }}
        location ~ ^/v2/health/(ready|live)$ {{
            client_max_body_size 1k;
            proxy_pass http://launcher_status;
        }}
        location ~ {CONTROL_HTTP_PATTERN} {{
            return 403 {_json_error(messages["control"])};
        }}
        location ~ "^(/v2|/v2/models/stats|{_MODEL}(/ready|/config|/stats)?)$" {{
            client_max_body_size 1k;
            if ($request_method !~ ^(GET|HEAD)$) {{
                return 405 {_json_error(messages["method"])};
            }}
            # Triton needs none of the client's headers here (nor their size).
            proxy_pass_request_headers off;
            proxy_pass http://triton_http;
        }}
        location / {{
            return 404 {_json_error(messages["not_found"])};
        }}
        location @too_large {{
            return 413 {_json_error(messages["too_large"])};
        }}
        location @json_too_large {{
            return 413 {_json_error(messages["json_too_large"])};
        }}
        location @header_too_large {{
            return 431 {_json_error(messages["header_too_large"])};
        }}
        location @client_overloaded {{
            add_header Retry-After 1 always;
            return 503 {_json_error(messages["client_overloaded"])};
        }}
        location @unavailable {{
            return 503 {_json_error(messages["unavailable"])};
        }}
    }}

    # ---------------------------------------------------------------- HTTP in-flight gate (loopback)
    server {{
        listen 127.0.0.1:{config.gate_port} backlog=4096;
        client_max_body_size {config.max_body_bytes};
        proxy_request_buffering off;  # the public server has the whole body already
        limit_conn inflight {config.max_inflight};
        error_page 429 = @overloaded;
        error_page 502 503 504 = @unavailable;
        location / {{
            proxy_pass http://screen_http;
        }}
        location @overloaded {{
            add_header Retry-After 1 always;
            return 503 {_json_error(messages["overloaded"])};
        }}

        location @unavailable {{
            return 503 {_json_error(messages["unavailable"])};
        }}
    }}

    # ---------------------------------------------------------------- gRPC ({config.grpc_port})
    server {{
        listen {address}:{config.grpc_port} http2 backlog=4096;
        client_max_body_size {config.max_body_bytes};
        # Streams of one connection (nginx's default): beyond them a client queues its own calls,
        # within them it is refused at once past its share.
        http2_max_concurrent_streams 128;
        grpc_read_timeout {config.upstream_timeout_s}s;
        grpc_send_timeout {config.upstream_timeout_s}s;
        grpc_set_header triton-control-key "";
        error_page 413 = /__grpc_too_large;
        error_page 502 503 504 = /__grpc_unavailable;
        error_page 429 = /__grpc_overloaded;
        error_page 415 = /__grpc_compressed;

        location = /{GRPC_SERVICE}/ModelInfer {{
            if ($grpc_encoding_ok = 0) {{
                return 415;
            }}
            limit_conn inflight {config.max_inflight};
            {client_limit}
            grpc_pass grpc://screen_grpc;
        }}
        location ~ ^/{GRPC_SERVICE.replace(".", chr(92) + ".")}/({"|".join(PUBLIC_GRPC_METHODS)})$ {{
            grpc_pass grpc://triton_grpc;
        }}
        location ~ ^/{GRPC_SERVICE.replace(".", chr(92) + ".")}/ {{
            return 403;
        }}
        location / {{
            return 404;
        }}
        error_page 403 = /__grpc_denied;
        error_page 404 = /__grpc_unimplemented;
{_grpc_error_location("__grpc_too_large", GRPC_RESOURCE_EXHAUSTED, messages["too_large"])}\
{_grpc_error_location("__grpc_denied", GRPC_PERMISSION_DENIED, messages["control"])}\
{_grpc_error_location("__grpc_unimplemented", GRPC_UNIMPLEMENTED, "unknown gRPC method")}\
{_grpc_error_location("__grpc_unavailable", GRPC_UNAVAILABLE, messages["unavailable"])}\
{_grpc_error_location("__grpc_overloaded", GRPC_UNAVAILABLE, messages["grpc_overloaded"])}\
{_grpc_error_location("__grpc_compressed", GRPC_UNIMPLEMENTED, messages["grpc_encoding"])}\
    }}

    # ---------------------------------------------------------------- metrics ({config.metrics_port})
    server {{
        listen {address}:{config.metrics_port};
        client_max_body_size 1k;
        location = /metrics {{
            if ($request_method !~ ^(GET|HEAD)$) {{
                return 405 {_json_error(messages["method"])};
            }}
            proxy_pass http://launcher_status;
        }}
        location / {{
            return 404 {_json_error(messages["not_found"])};
        }}
    }}
}}
"""
    return lines


TEMP_FOLDERS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def worker_temp_dir(state: Path, run_as: str | None) -> Path:
    """Where nginx's workers write request bodies larger than their buffer. Started as root, the
    workers run as ``run_as`` and must reach the folder: the state folder may sit under a private
    one (/root, a 0700 temp folder), so they get a folder of their own under the system's temp
    folder (world-traversable), owned by them."""
    if not run_as:
        for name in TEMP_FOLDERS:
            (state / name).mkdir(exist_ok=True)
        return state
    import pwd

    user = pwd.getpwnam(run_as.split()[0])
    temp = Path(tempfile.mkdtemp(prefix="triton-proxy-"))
    os.chmod(temp, 0o711)  # traverse, not list
    for name in TEMP_FOLDERS:
        (temp / name).mkdir(mode=0o700)
        os.chown(temp / name, user.pw_uid, user.pw_gid)
    return temp


class ProxyProcess:
    """nginx in the foreground with a generated configuration under ``config.state_dir``."""

    def __init__(self, config: ProxyConfig, stdout=None, stderr=None):
        self.config = config
        state = config.state_dir
        state.mkdir(parents=True, exist_ok=True)
        self.temp_dir = worker_temp_dir(state, config.run_as)
        self.config_path = state / "nginx.conf"
        self.config_path.write_text(render_config(config, self.temp_dir))
        self.binary = nginx_binary()
        check = subprocess.run([self.binary, *self._error_log(), "-t", "-q", "-p", str(state),
                                "-c", str(self.config_path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"the generated nginx configuration is invalid: {check.stderr.strip()}")
        self.stdout, self.stderr = stdout, stderr
        self.process = self._start()

    def _error_log(self) -> list[str]:
        """``-e stderr`` (nginx >= 1.19.5): a non-root nginx would first try /var/log/nginx/error.log."""
        version = subprocess.run([self.binary, "-v"], capture_output=True, text=True).stderr
        found = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", version)
        return ["-e", "stderr"] if found and tuple(map(int, found.groups())) >= (1, 19, 5) else []

    def _start(self) -> subprocess.Popen:
        return spawn([self.binary, *self._error_log(), "-p", str(self.config.state_dir), "-c", str(self.config_path)],
                     stdout=self.stdout, stderr=self.stderr, start_new_session=True)

    def restart(self) -> None:
        self._stop_process()
        self.process = self._start()

    def reconfigure(self, config: ProxyConfig, timeout_s: float = 60) -> None:
        """New upstreams (replicas in service) without dropping a request: nginx's graceful reload
        starts workers on the new configuration while the old ones finish what they are serving.
        Returns when the old workers are gone: no request is on its way to a removed upstream."""
        text = render_config(config, self.temp_dir)
        if text == self.config_path.read_text():
            return
        old_workers = set(child_pids(self.process.pid))
        candidate = self.config_path.with_suffix(".next")
        candidate.write_text(text)
        check = subprocess.run([self.binary, *self._error_log(), "-t", "-q", "-p", str(config.state_dir),
                                "-c", str(candidate)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"the generated nginx configuration is invalid: {check.stderr.strip()}")
        os.replace(candidate, self.config_path)
        self.config = config
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while old_workers & set(child_pids(self.process.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10) -> None:
        self._stop_process(timeout_s)
        if self.temp_dir != self.config.state_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _stop_process(self, timeout_s: float = 10) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # graceful: finish requests in flight
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
