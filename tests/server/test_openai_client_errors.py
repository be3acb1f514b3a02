"""Client errors on the public port's ``/v1`` (issue 33 §4), sent raw through nginx to the real
frontend: numbers of any size, fields of the wrong JSON type, an Authorization header of non-UTF-8
bytes, malformed multipart part headers. Each is a 400 or 401 in OpenAI's error shape naming what is
wrong (never a 500), and a neighbour request is still served.

The server is ``tests/server/test_openai_server.py``'s (its fixtures and helpers, imported): one for
this module, keys on, the gateway variables pointing at the fake gateway."""

from __future__ import annotations

import json
import socket

import pytest

from tests.conftest import LOG_DIR
from tests.server import test_openai_server as openai_server
from tests.server.test_openai_server import (
    HELLO,
    KEY,
    MODEL_PART,
    assert_openai_error,
    neighbour_is_served,
    post,
)

# test_openai_server.py's fixtures, by name (module scope: one server for this module)
server, client = openai_server.server, openai_server.client

JSON_HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
CHAT = {"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}]}


def chat_body(**fields) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


# ------------------------------------------------------------------------------------ numbers of any size
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "temperature", "top_p", "seed"])
def test_an_integer_of_400_digits_is_400_naming_the_field(server, client, field):
    body = json.dumps(CHAT)[:-1].encode() + f', "{field}": {"9" * 400}}}'.encode()
    status, _, answer = post(server, "/v1/chat/completions", body, JSON_HEADERS)
    error = assert_openai_error(status, answer, 400, field)
    assert error["type"] == "invalid_request_error" and "400 digits" in error["message"]
    neighbour_is_served(client)


# ------------------------------------------------------------------------------------ JSON types
@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "7"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": 7.5}, "max_completion_tokens"), ({"temperature": "0.5"}, "temperature"),
    ({"stream": "true"}, "stream"), ({"stream": True, "stream_options": {"include_usage": "no"}},
                                     "stream_options.include_usage"),
])
def test_a_field_of_the_wrong_json_type_is_400_invalid_type(server, client, fields, param):
    status, _, answer = post(server, "/v1/chat/completions", chat_body(**fields), JSON_HEADERS)
    assert assert_openai_error(status, answer, 400, param)["code"] == "invalid_type"
    neighbour_is_served(client)


def test_an_embeddings_field_of_the_wrong_type_is_400(server, client):
    body = json.dumps({"model": "text_embedding", "input": "x", "encoding_format": 1}).encode()
    status, _, answer = post(server, "/v1/embeddings", body, JSON_HEADERS)
    assert assert_openai_error(status, answer, 400, "encoding_format")["code"] == "invalid_type"
    neighbour_is_served(client)


# ------------------------------------------------------------------------------------ Authorization
def raw_exchange(server, request: bytes) -> tuple[int, bytes]:
    host, port = server.http_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize("authorization", [b"Bearer sk-\xff\xfe-0123456789", b"Bearer \x80", b"\xc3\x28 sk-x"])
def test_an_authorization_header_of_non_utf8_bytes_is_401_without_a_log_line(server, client, authorization):
    body = chat_body()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
               b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
               b"Authorization: " + authorization + b"\r\n\r\n" + body)
    status, answer = raw_exchange(server, request)
    assert assert_openai_error(status, answer, 401, None)["code"] == "invalid_api_key"
    neighbour_is_served(client)
    log = LOG_DIR / "test-openai-server.log"
    if log.exists():
        assert "UnicodeEncodeError" not in log.read_text(errors="replace")


# ------------------------------------------------------------------------------------ multipart
def raw_multipart(file_headers: bytes) -> tuple[bytes, dict]:
    """A transcription body whose ``file`` part has exactly these header lines (then the audio)."""
    name, _, value = MODEL_PART
    body = (f'--B\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + value + b"\r\n"
            b"--B\r\n" + file_headers + b"\r\n\r\n" + HELLO.read_bytes() + b"\r\n--B--\r\n")
    return body, {"Content-Type": "multipart/form-data; boundary=B", "Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("file_headers, says", [
    (b'Content-Disposition: form-data; name="file"; filename="a\r\nb.wav"', "a line break (CR or LF)"),
    (b'Content-Disposition: form-data; name="file"; filename="a\r\nX-Injected: b.wav"', "does not close"),
    (b'Content-Disposition: form-data; name="x"; name="file"; filename="a.wav"', "has the parameter 'name' twice"),
    (b"Content-Type: audio/wav", "has no Content-Disposition header"),
])
def test_a_malformed_part_header_is_400_saying_what_is_wrong(server, client, file_headers, says):
    body, headers = raw_multipart(file_headers)
    status, _, answer = post(server, "/v1/audio/transcriptions", body, headers)
    error = assert_openai_error(status, answer, 400)
    assert says in error["message"] and "longer than" not in error["message"], error
    neighbour_is_served(client)


# ------------------------------------------------------------------------------------ paths and methods
def raw_request(server, request_line: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of one request line sent as it is (no client normalizes it)."""
    host, port = server.http_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(f"{request_line}\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n"
                           "Content-Length: 0\r\n\r\n".encode())
        data = b""
        while chunk := connection.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    content_type = next((line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith("content-type:")),
                        "")
    return int(lines[0].split()[1]), content_type, body


@pytest.mark.parametrize("request_line, status, code", [
    ("PUT /v1/chat/completions HTTP/1.1", 405, "method_not_allowed"),
    ("DELETE /v1/models HTTP/1.1", 405, "method_not_allowed"),
    ("FOO /v1/models HTTP/1.1", 405, "method_not_allowed"),  # the frontend's parser knows no FOO
    ("GET /v1/nope HTTP/1.1", 404, "not_found"),
    ("POST /v1/chat/completions/extra HTTP/1.1", 404, "not_found"),
    ("GET //v1/models HTTP/1.1", 404, "not_found"),  # nginx merges the slashes, the frontend would not
    ("GET /%761/models HTTP/1.1", 404, "not_found"),  # nor decode the path
    ("GET /v1 HTTP/1.1", 404, "not_found"),  # not nginx's 301 to /v1/ in HTML
    ("GET /v1/models%00 HTTP/1.1", 400, "bad_request"),  # nginx refuses the path itself
])
def test_a_path_or_method_v1_does_not_have_is_answered_in_openais_shape(server, client, request_line, status, code):
    """Issue 33 §4: unknown methods, //v1/models and %00 were answered by nginx's HTML pages or
    aiohttp's plain text (and a traceback in the frontend's log for an unknown method token)."""
    answered, content_type, body = raw_request(server, request_line)
    assert content_type.startswith("application/json"), (request_line, answered, body[:200])
    error = assert_openai_error(answered, body, status)
    assert error["code"] == code and error["type"] == "invalid_request_error"
    if status == 405:
        assert request_line.split()[0] in error["message"]
    neighbour_is_served(client)


def test_no_v1_refusal_leaves_a_traceback_in_the_log(server, client):
    for request_line in ("FOO /v1/models HTTP/1.1", "GET //v1/models HTTP/1.1", "GET /v1/%00 HTTP/1.1"):
        raw_request(server, request_line)
    neighbour_is_served(client)
    assert "Traceback" not in (LOG_DIR / "test-openai-server.log").read_text(errors="replace")
