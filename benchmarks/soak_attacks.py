"""The hostile round 3's attack classes (issue 33) for ``make soak``: each is one call against the
public ports that must be refused (it raises ``Refused`` when the server refused it as it should,
and returns when the attack got through), while the soak's neighbours keep their traffic.

- /v1: a JSON structure bomb within the body limit; a multipart preamble of newlines; an integer of
  400 digits in ``max_tokens``; a chat message with a lone surrogate (a client's error: 400 before
  any model is tried, so the breaker is not poisoned: the soak's gateway tasks keep succeeding);
  ``max_tokens`` as a string.
- native HTTP: the fields Triton 2.51 answers with 500 "Unable to parse" (``binary_data: "yes"``,
  ``sequence_id`` -1, ``priority`` "x", ``timeout`` 1e300), each a 400 from the screen.
- gRPC: 16 streams that send only HEADERS (closed by the screen within its first-message time, no
  place held); a 60 s clip with a 2 s deadline (DEADLINE_EXCEEDED; the decode loop stops).
- raw HTTP: request lines a client library would never send (``FOO /v1/models``, ``//v1/models``,
  ``/v1/models%00``) and a malformed ``Inference-Header-Content-Length``: each a 4xx in JSON, never
  nginx's HTML or the frontend's plain text; a /v1 chat whose client sends half its body and resets
  the connection (nothing to refuse: what it must not cost is the neighbours' answers and a
  traceback in the log, which the report's failures and the log show).
"""

from __future__ import annotations

import io
import json
import socket
import struct
import time
import urllib.error
import urllib.request

import numpy as np

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor
from triton_pipelines.front.nginx_config import GRPC_SERVICE
from triton_pipelines.limits import STREAM_FIRST_MESSAGE_S


class Refused(Exception):
    """The server refused the attack as it should."""


def _post(url: str, body: bytes, headers: dict[str, str]) -> None:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
    except urllib.error.HTTPError as error:
        if 400 <= error.code < 500:
            raise Refused(f"{error.code}") from None
        raise  # a 5xx is a failure of ours, not a refusal


def _raw(address: str, request: bytes, reset_after: bool = False) -> tuple[int, bytes]:
    """(status, head) of one request sent as these bytes; ``reset_after``: close with RST, unread."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(request)
        if reset_after:
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return 0, b""
        data = b""
        while chunk := connection.recv(65536):
            data += chunk
    head = data.partition(b"\r\n\r\n")[0]
    return int(head.split(b" ", 2)[1]), head


def long_clip(wav: bytes, seconds: float = 60.0) -> bytes:
    import soundfile

    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    tiled = np.tile(samples, int(np.ceil(seconds * rate / len(samples))))[: int(seconds * rate)]
    out = io.BytesIO()
    soundfile.write(out, tiled, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def attacks(server, wav: bytes) -> list:
    http = f"http://{server.http_url}"
    json_headers = {"Content-Type": "application/json"}
    clip = long_clip(wav)

    def v1_json(path: str, document: str):
        return lambda: _post(http + path, document.encode("utf-8", "surrogatepass"), json_headers)

    def chat(**fields):
        body = {"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}], **fields}
        return v1_json("/v1/chat/completions", json.dumps(body))

    def native(document: dict):
        return lambda: _post(http + "/v2/models/text_embedding/infer", json.dumps(document).encode(), json_headers)

    one_text = {"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}

    def preamble():
        boundary = "soakboundary"
        body = b"\n" * (2 << 20) + f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n" \
            f"speech_recognition\r\n--{boundary}--\r\n".encode()
        _post(http + "/v1/audio/transcriptions", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})

    def headers_only():
        from tests.support.h2_streams import HeadersOnly

        host, port = server.grpc_url.rsplit(":", 1)
        attacker = HeadersOnly(host, int(port), f"/{GRPC_SERVICE}/ModelStreamInfer", "127.0.0.5", 16)
        try:
            deadline = time.monotonic() + STREAM_FIRST_MESSAGE_S + 10
            while attacker.ended() < 16 and time.monotonic() < deadline:
                time.sleep(0.2)
            if attacker.ended() == 16:
                raise Refused("every HEADERS-only stream was closed")
        finally:
            attacker.close()

    def past_deadline():
        client = TritonClient("grpc", server.grpc_url)
        try:
            client.client.infer("speech_recognition", client._inputs({"audio": text_tensor([clip])}),
                                client_timeout=2.0)
        except InferenceServerException as error:
            if "Deadline" in str(error) or "DEADLINE" in str(error.status() or ""):
                raise Refused("deadline exceeded") from None
            raise
        finally:
            client.close()

    def raw_lines():
        for line in (b"FOO /v1/models", b"GET //v1/models", b"GET /v1/models%00"):
            status, head = _raw(server.http_url, line + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            if not (400 <= status < 500 and b"application/json" in head):
                return  # got through: a 5xx, a 2xx or an answer not in JSON
        raise Refused("4xx in JSON")

    def malformed_length():
        _post(http + "/v2/models/text_embedding/infer", b"{}",
              {"Content-Type": "application/json", "Inference-Header-Content-Length": "12abc"})

    def half_body_reset():
        body = json.dumps({"model": "gpt-4.1", "messages": [{"role": "user", "content": "x" * 4000}]}).encode()
        _raw(server.http_url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:len(body) // 2], reset_after=True)
        raise Refused("nothing to answer")

    return [
        raw_lines,
        malformed_length,
        half_body_reset,
        v1_json("/v1/embeddings", '{"model": "text_embedding", "input": [' + "[]," * 40_000 + "[]]}"),
        preamble,
        chat(max_tokens=int("9" * 400)),
        v1_json("/v1/chat/completions", '{"model": "gpt-4.1", "messages": [{"role": "user", "content": "\\ud800"}]}'),
        chat(max_tokens="7"),
        native({"inputs": [one_text], "outputs": [{"name": "embedding", "parameters": {"binary_data": "yes"}}]}),
        native({"inputs": [one_text], "parameters": {"sequence_id": -1}}),
        native({"inputs": [one_text], "parameters": {"priority": "x"}}),
        native({"inputs": [one_text], "parameters": {"timeout": 1e300}}),
        headers_only,
        past_deadline,
    ]
