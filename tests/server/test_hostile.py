"""A hostile client against the real stack, through its public ports: requests that used to crash
tritonserver 2.51, anonymous control, oversized bodies, slow clients, router rows that blow up,
and the input budgets. Every case ends by checking that the server still serves everyone else.

Fault and overload cases that change the server (a killed stub, a crashed server, a hung gateway,
3x overload) are in test_faults.py, on a server of their own."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor
from triton_pipelines.server.control import CONTROL_HEADER
from triton_pipelines.server.processes import SHM_DIR

from tests.support.router_helpers import metric, route, scrape
from tests.server.test_vision_server import png_bomb
from tests.support.paths import TEST_DATA

DATA = TEST_DATA
EMBED = {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["still alive?"]}]}


def post(url: str, body: bytes, headers: dict | None = None, method: str = "POST",
         timeout: float = 30) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def assert_serving(server) -> None:
    """The server is alive and answers a real inference on both protocols."""
    status, _ = post(f"http://{server.http_url}/v2/health/ready", None, method="GET")
    assert status == 200
    status, body = post(f"http://{server.http_url}/v2/models/text_embedding/infer", json.dumps(EMBED).encode())
    assert status == 200 and len(json.loads(body)["outputs"][0]["data"]) == 384
    client = TritonClient("grpc", server.grpc_url)
    assert client.infer("text_embedding", {"text": text_tensor(["grpc too"])})["embedding"].shape == (1, 384)
    client.close()


def error_of(body: bytes) -> str:
    return json.loads(body)["error"]


# ------------------------------------------------------------------------------------ crashers
def test_json_bodies_that_crashed_tritonserver_get_413_and_it_keeps_serving(triton_server):
    """Triton 2.51 died with SIGSEGV on a ~4 MiB JSON body and on JSON nested ~104,000 deep."""
    url = f"http://{triton_server.http_url}/v2/models/text_embedding/infer"
    flat = json.dumps({"id": "x" * 4_200_000, "inputs": []}).encode()
    deep = b'{"id":' + b"[" * 150_000 + b"]" * 150_000 + b',"inputs":[]}'
    for body in (flat, deep):
        status, answer = post(url, body)
        assert status == 413 and "the JSON part of a request is limited to 131072 bytes" in error_of(answer)
        assert "binary" in error_of(answer)  # the message says what to do instead
    # the same JSON as the header of a binary request: over the limit (413), or not a length (400)
    status, answer = post(url, flat, {"Inference-Header-Content-Length": "4200000"})
    assert status == 413 and "the JSON part of a request is limited to 131072 bytes" in error_of(answer)
    for length in ("12abc", "-5", "0x10", "1e3", " "):  # (empty: nginx cannot tell it from none; the screen can)
        status, answer = post(url, b"{}", {"Inference-Header-Content-Length": length})
        assert status == 400 and "Inference-Header-Content-Length must be a decimal number" in error_of(answer), (
            length, status, answer)
    # A compressed body could inflate past every limit after the proxy.
    status, answer = post(url, b"\x1f\x8b" + bytes(100), {"Content-Encoding": "gzip"})
    assert status == 415 and "uncompressed" in error_of(answer)
    assert_serving(triton_server)


def test_json_just_under_the_limit_nested_as_deep_as_it_can_be_is_harmless(triton_server):
    depth = (131072 - 40) // 2  # 65,516 levels: the deepest JSON the proxy lets through
    body = b'{"id":' + b"[" * depth + b"]" * depth + b',"inputs":[]}'
    assert len(body) <= 131072
    status, _ = post(f"http://{triton_server.http_url}/v2/models/text_embedding/infer", body)
    assert status in (400, 500)  # Triton's own "id is not a string", not a crash
    assert_serving(triton_server)


def test_requests_over_the_body_limit_are_refused_before_triton_reads_them(triton_server, client):
    huge = text_tensor([b"a" * (65 << 20)])  # 65 MiB: over the 64 MiB limit, binary
    with pytest.raises(InferenceServerException) as error:
        client.infer("text_embedding", {"text": huge})
    message = str(error.value)
    assert "request body exceeds the server's limit of 67108864 bytes" in message
    assert ("413" in message) if client.protocol == "http" else ("RESOURCE_EXHAUSTED" in message)
    assert_serving(triton_server)


def test_slow_and_idle_connections_do_not_starve_others(triton_server):
    host, port = triton_server.http_url.rsplit(":", 1)
    idle = []
    for _ in range(300):  # half-sent requests, as a slowloris client leaves them
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"POST /v2/models/text_embedding/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n")
        idle.append(s)
    try:
        started = time.monotonic()
        assert_serving(triton_server)
        assert time.monotonic() - started < 5
    finally:
        for s in idle:
            s.close()


# ------------------------------------------------------------------------------------ control
CONTROL_PATHS = [
    ("POST", "/v2/repository/index", {}),
    ("POST", "/v2/repository/models/evil/load", {"parameters": {
        "config": json.dumps({"name": "evil", "backend": "python"}),
        "file:1/model.py": base64.b64encode(b"import os\nos.system('touch /tmp/pwned')\n").decode()}}),
    ("POST", "/v2/repository/models/text_embedding/unload", {}),
    ("POST", "/v2/logging", {"log_verbose_level": 1}),
    ("GET", "/v2/logging", None),
    ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
    ("POST", "/v2/models/text_embedding/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
    ("POST", "/v2/systemsharedmemory/region/r/register", {"key": "/r", "offset": 0, "byte_size": 64}),
    ("GET", "/v2/systemsharedmemory/status", None),
    ("POST", "/v2/cudasharedmemory/region/r/unregister", {}),
]


@pytest.mark.parametrize("method, path, body", CONTROL_PATHS, ids=[p for _, p, _ in CONTROL_PATHS])
def test_control_apis_are_refused_on_the_public_http_port(triton_server, method, path, body):
    data = json.dumps(body).encode() if body is not None else None
    for headers in ({}, {CONTROL_HEADER: triton_server.key}):  # not even with the key
        status, answer = post(f"http://{triton_server.http_url}{path}", data, headers, method=method)
        assert status == 403 and "restricted to the server's own host" in error_of(answer)
    assert triton_server.control.states().get("text_embedding") == "READY"
    assert "evil" not in triton_server.control.states()


def test_control_apis_are_refused_on_the_public_grpc_port(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    calls = [lambda h: client.get_model_repository_index(headers=h), lambda h: client.load_model("evil", headers=h),
             lambda h: client.unload_model("text_embedding", headers=h), lambda h: client.get_log_settings(headers=h),
             lambda h: client.update_log_settings({"log_verbose_level": 1}, headers=h),
             lambda h: client.get_trace_settings(headers=h),
             lambda h: client.get_system_shared_memory_status(headers=h),
             lambda h: client.register_system_shared_memory("r", "/r", 64, headers=h)]
    for call in calls:
        for headers in (None, {CONTROL_HEADER: triton_server.key}):
            with pytest.raises(InferenceServerException) as error:
                call(headers)
            assert error.value.status() == "StatusCode.PERMISSION_DENIED"
            assert "restricted to the server's own host" in error.value.message()
    assert client.is_model_ready("text_embedding")
    client.close()


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (/proc/net/tcp and tcp6; an
    IPv4-mapped IPv6 address counts as its IPv4 address)."""
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:
                continue
            raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
            text = socket.inet_ntop(family, raw)
            found.add(text.removeprefix("::ffff:"))
    return found


def test_everything_listens_on_loopback_and_triton_wants_the_key(triton_server):
    options, internal = triton_server.options, triton_server.internal
    for port in (options.http_port, options.grpc_port, options.metrics_port,
                 internal.http, internal.grpc, internal.metrics):
        assert listening_addresses(port) == {"127.0.0.1"}, port
    status, answer = post(f"http://{triton_server.control.http_url}/v2/repository/index", b"{}")
    assert status == 403 and CONTROL_HEADER in error_of(answer)
    assert triton_server.control.index()  # with the key


def test_unknown_paths_and_wrong_methods(triton_server):
    base = f"http://{triton_server.http_url}"
    assert post(f"{base}/v2/models/text_embedding/generate", b"{}")[0] == 404
    assert post(f"{base}/../etc/passwd", None, method="GET")[0] in (400, 404)
    assert post(f"{base}/v2/models/text_embedding/config", b"{}")[0] == 405
    status, answer = post(f"{base}/v2/models/text_embedding/config", None, method="GET")
    assert status == 200 and json.loads(answer)["name"] == "text_embedding"
    assert post(triton_server.metrics_url, b"x")[0] == 405


def test_a_request_nginx_cannot_parse_is_a_json_400(triton_server):
    """A %00 in the path was nginx's HTML page; now Triton's error shape ({"error": ...})."""
    host, port = triton_server.http_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(b"GET /v2/models/text_embedding%00/config HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := connection.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, data[:300]
    assert "request is malformed" in error_of(body)
    assert_serving(triton_server)


# ------------------------------------------------------------------------------------ router rows
def test_a_router_row_that_breaks_fails_alone_with_a_clean_message(triton_server):
    """A payload nested 100,000 deep and a lone surrogate used to raise inside execute(): the whole
    dynamic batch failed with a traceback. Now each is a 400 for its own request only."""
    nested = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
    surrogate = '{"text": "a\\ud800"}'
    before = scrape(triton_server.metrics_url)
    clients = [TritonClient("grpc", triton_server.grpc_url) for _ in range(37)]

    def send(i):
        payload = nested if i == 10 else surrogate if i == 20 else {"text": f"refund request {i}"}
        try:
            return route(clients[i], "text_classification", payload)
        except InferenceServerException as error:
            return error

    with ThreadPoolExecutor(37) as pool:
        results = list(pool.map(send, range(37)))
    for c in clients:
        c.close()
    bad = {10: "payload is nested too deeply to parse", 20: "lone UTF-16 surrogate"}
    for i, result in enumerate(results):
        if i in bad:
            assert isinstance(result, InferenceServerException), i
            assert bad[i] in result.message() and result.status() == "StatusCode.INVALID_ARGUMENT"
            assert not re.search(r"Traceback|/work/|/tmp/|/usr/|\.py\b", result.message()), result.message()
        else:
            assert not isinstance(result, InferenceServerException), (i, result)
            assert result["output"]["label"]
    after = scrape(triton_server.metrics_url)
    failures = (metric(after, "router_failures_total", task="text_classification", reason="invalid_input")
                - metric(before, "router_failures_total", task="text_classification", reason="invalid_input"))
    assert failures == 2


def test_router_passes_the_pipelines_input_errors_on_as_400(triton_server, client):
    with pytest.raises(InferenceServerException) as error:
        route(client, "image_classification", {"image": base64.b64encode(b"not an image at all").decode()})
    assert "not a recognized image" in str(error.value)
    assert "400" in str(error.value) or "INVALID_ARGUMENT" in str(error.value)
    with pytest.raises(InferenceServerException) as error:
        route(client, "vision_llm", {"text": "what is this?", "image": base64.b64encode(b"png").decode(),
                                     "image_mime": "text/html;base64,PHNjcmlwdD4="})
    assert "payload field 'image_mime' must be one of image/png" in str(error.value)
    assert "400" in str(error.value) or "INVALID_ARGUMENT" in str(error.value)


# ------------------------------------------------------------------------------------ budgets
def test_audio_that_would_decode_to_too_many_samples_is_refused_from_its_header(triton_server, client):
    """8 channels at 192 kHz: a small FLAC of silence that would decode to ~31 M samples (299 s of
    it: 459 M). Refused before decoding, in well under a second of work."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros((192_000 * 20, 8), dtype=np.int16), 192_000, format="FLAC")
    flac = buffer.getvalue()
    assert len(flac) < 2 << 20
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as error:
        client.infer("speech_recognition", {"audio": text_tensor([flac])})
    assert time.monotonic() - started < 5
    assert "decodes to 30720000 samples (8 channels × 192000 Hz × 20.0 s); the limit is 28800000" in str(error.value)
    assert_serving(triton_server)


def test_one_request_cannot_buy_unbounded_image_decoding(triton_server, client):
    """The pixel limit is per image (50 MP) and per request (100 MP), both from the headers."""
    three = text_tensor([png_bomb(7000, 7000)] * 3)  # 147 MP together
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as error:
        client.infer("image_classification", {"image": three})
    assert "hold 147000000 pixels together; the limit per request is 100000000" in str(error.value)
    assert time.monotonic() - started < 5
    two = client.infer("image_classification", {"image": text_tensor([png_bomb(7000, 7000)] * 2)})
    assert two["labels"].shape[0] == 2  # 98 MP: within the budget, decoded and classified
    assert_serving(triton_server)


def shm_bytes(server) -> int:
    return sum(p.stat().st_size for p in SHM_DIR.glob(f"{server.shm_prefix}*"))


def test_shared_memory_stays_bounded_after_repeated_large_rejected_requests(triton_server):
    """A 60 MB gRPC request passes the proxy (under 64 MiB) and is refused by the tokenizer: its
    stub's region grows once to hold it and is reused after; over the limit nothing reaches Triton."""
    client = TritonClient("grpc", triton_server.grpc_url)
    large = text_tensor([b"w" * (60 << 20)])
    sizes = []
    for _ in range(4):
        with pytest.raises(InferenceServerException, match="the limit is 65536 bytes"):
            client.infer("text_embedding", {"text": large})
        sizes.append(shm_bytes(triton_server))
    assert sizes[-1] == sizes[0], sizes
    over = text_tensor([b"w" * (70 << 20)])
    for _ in range(3):
        with pytest.raises(InferenceServerException, match="RESOURCE_EXHAUSTED|exceeds the server's limit"):
            client.infer("text_embedding", {"text": over})
    assert shm_bytes(triton_server) == sizes[0]
    client.close()
    assert_serving(triton_server)
