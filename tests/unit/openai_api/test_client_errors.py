"""Client errors of the ``/v1`` frontend (issue 33 §4) answered as OpenAI does, not as 500s or
confusing messages: numeric fields of any size, fields of the wrong JSON type, an Authorization
header of non-UTF-8 bytes, malformed multipart part headers. The protocol's checks directly, and
the aiohttp application (``app.Frontend``, no Triton: every request here is refused before it) over
a loopback socket with the raw hostile bytes."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from triton_pipelines.gateway.keys import KeyRing
from triton_pipelines.openai_api import protocol as proto
from triton_pipelines.openai_api.multipart import parse_disposition

from tests.support.loopback_frontend import CATALOG, KEY, with_frontend

CHAT = {"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}]}
HUGE = int("9" * 400)  # more digits than a float holds (float(HUGE) is OverflowError)


def error_of(call, *args) -> proto.OpenAIError:
    with pytest.raises(proto.OpenAIError) as caught:
        call(*args)
    return caught.value


# ------------------------------------------------------------------------------------ numbers of any size
@pytest.mark.parametrize("field", [*proto.CHAT_NUMBERS, *proto.CHAT_INTEGERS])
@pytest.mark.parametrize("value", [HUGE, -HUGE], ids=["huge", "-huge"])
def test_an_integer_of_400_digits_in_any_numeric_field_is_400_naming_it(field, value):
    error = error_of(proto.parse_chat, {**CHAT, field: value}, CATALOG)
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", field)
    assert "400 digits" in error.message and error.code.endswith(("_max_value", "_min_value"))


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e308 * 10])
def test_non_finite_numbers_are_400(value):
    error = error_of(proto.parse_chat, {**CHAT, "temperature": value}, CATALOG)
    assert error.status == 400 and error.param == "temperature"


def test_a_numeric_multipart_field_of_400_digits_is_400():
    error = error_of(proto.parse_transcription, {"model": "speech_recognition", "temperature": "9" * 400},
                     "a.wav", 10, "transcribe", CATALOG, ("en",))
    assert error.status == 400 and error.param == "temperature"


# ------------------------------------------------------------------------------------ JSON types
@pytest.mark.parametrize("field, value, expected, got", [
    ("max_tokens", "7", "an integer", "a string"), ("max_tokens", True, "an integer", "a boolean"),
    ("max_tokens", 7.5, "an integer", "a decimal"), ("max_completion_tokens", [7], "an integer", "an array"),
    ("n", "1", "an integer", "a string"), ("seed", 1.0, "an integer", "a decimal"),
    ("temperature", "0.5", "a number", "a string"), ("temperature", False, "a number", "a boolean"),
    ("top_p", {}, "a number", "an object"), ("stream", "true", "a boolean", "a string"),
    ("stream", 1, "a boolean", "an integer"), ("logprobs", "no", "a boolean", "a string"),
    ("stream_options", "include_usage", "an object", "a string"), ("user", 5, "a string", "an integer"),
    ("model", 4, "a string", "an integer"),
])
def test_a_field_of_the_wrong_json_type_is_400_invalid_type_naming_it(field, value, expected, got):
    error = error_of(proto.parse_chat, {**CHAT, field: value}, CATALOG)
    assert (error.status, error.param, error.code) == (400, field, "invalid_type")
    assert error.message == f"Invalid type for '{field}': expected {expected}, but got {got} instead."


@pytest.mark.parametrize("value", ["no", "false", 0, 1, "true"])
def test_include_usage_must_be_a_json_boolean(value):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": value}}
    error = error_of(proto.parse_chat, body, CATALOG)
    assert (error.status, error.param, error.code) == (400, "stream_options.include_usage", "invalid_type")


def test_well_typed_fields_pass_and_integers_are_numbers():
    request = proto.parse_chat({**CHAT, "max_tokens": 7, "temperature": 1, "top_p": 0.5, "seed": -3, "n": 1,
                                "stream": True, "stream_options": {"include_usage": False}, "logprobs": False},
                               CATALOG)
    assert request.stream and not request.include_usage
    assert proto.chat_arguments(request, 8192)["max_tokens"] == 7
    assert error_of(proto.parse_chat, {**CHAT, "n": 2}, CATALOG).param == "n"
    error = error_of(proto.parse_chat, {**CHAT, "max_tokens": 0}, CATALOG)
    assert error.code == "integer_below_min_value" and "Expected a value >= 1, but got 0" in error.message


def test_embedding_fields_are_typed_too():
    error = error_of(proto.parse_embeddings, {"model": "text_embedding", "input": "x", "encoding_format": 1},
                     CATALOG)
    assert (error.param, error.code) == ("encoding_format", "invalid_type")


def test_multipart_fields_are_text_read_as_their_type():
    def fields(extra):
        return proto.parse_transcription({"model": "speech_recognition", **extra}, "a.wav", 10, "transcribe",
                                         CATALOG, ("en",))

    assert fields({"stream": "TRUE", "temperature": "0.5"}).stream and not fields({"stream": "false"}).stream
    for name, value in (("stream", "no"), ("temperature", "warm"), ("temperature", "nan"), ("temperature", "2")):
        assert error_of(fields, {name: value}).param == name


# ------------------------------------------------------------------------------------ Content-Disposition
def test_content_disposition_is_read_strictly():
    assert parse_disposition('form-data; name="file"; filename="a \\"b\\".wav"') == (
        "form-data", {"name": "file", "filename": 'a "b".wav'})
    assert parse_disposition('Form-Data; NAME=model;') == ("form-data", {"name": "model"})
    assert parse_disposition('form-data; name="a;b=c"') == ("form-data", {"name": "a;b=c"})


@pytest.mark.parametrize("header, says", [
    ('form-data; name="x"; name="file"', "has the parameter 'name' twice"),
    ('form-data; name="file"; filename="a', "opens a quote in 'filename' that it does not close"),
    ('form-data; name=', "without a value: 'name'"),
    ('form-data; name', "without a value: 'name'"),
    ('form-data; name=a b', "neither a token nor one quoted string"),
    ('"form-data"; name=x', "does not start with its type"),
])
def test_a_malformed_content_disposition_says_what_is_wrong(header, says):
    error = error_of(parse_disposition, header)
    assert error.status == 400 and says in error.message, error.message


# ------------------------------------------------------------------------------------ the application
def exchange(raw_requests: list[bytes]) -> list[tuple[int, dict]]:
    """Each raw HTTP/1.1 request on its own connection to a loopback Frontend (keys on, no Triton)
    → (status, JSON body)."""
    return with_frontend(lambda port: [send(port, raw) for raw in raw_requests])


def send(port: int, raw: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(raw)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def request(path: str, body: bytes, content_type: str, authorization: bytes = b"Bearer " + KEY.encode()) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n").encode() + b"Authorization: " + authorization + b"\r\n\r\n" + body


def multipart_request(disposition: bytes, data: bytes = b"\0" * 20_000) -> bytes:
    body = (b'--B\r\nContent-Disposition: form-data; name="model"\r\n\r\nspeech_recognition\r\n'
            b"--B\r\n" + disposition + b"\r\n\r\n" + data + b"\r\n--B--\r\n")
    return request("/v1/audio/transcriptions", body, "multipart/form-data; boundary=B")


def test_an_authorization_header_of_non_utf8_bytes_is_401_without_a_log_line(capfd):
    chat = json.dumps(CHAT).encode()
    answers = exchange([request("/v1/chat/completions", chat, "application/json", b"Bearer sk-\xff\xfe-0123456789"),
                        request("/v1/chat/completions", chat, "application/json", b"\xc3\x28 sk"),
                        request("/v1/chat/completions", chat, "application/json", b"Bearer sk-\x80")])
    for status, body in answers:
        assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "invalid_api_key"
    logged = capfd.readouterr().err
    assert "[openai]" not in logged and "Traceback" not in logged and "UnicodeEncodeError" not in logged


@pytest.mark.parametrize("part, says", [
    (b'Content-Disposition: form-data; name="file"; filename="a\r\nb.wav"', "a line break (CR or LF)"),
    (b'Content-Disposition: form-data; name="file"; filename="a\r\nX-Injected: b.wav"', "does not close"),
    (b'Content-Disposition: form-data; name="x"; name="file"; filename="a.wav"', "has the parameter 'name' twice"),
    (b"Content-Type: audio/wav", "has no Content-Disposition header"),
    (b"Content-Disposition: form-data", "has no name"),
    (b'Content-Disposition: form-data; name="file"\r\nContent-Disposition: form-data; name="x"',
     "two Content-Disposition headers"),
])
def test_a_malformed_part_header_is_400_saying_what_is_wrong(part, says):
    (status, body), = exchange([multipart_request(part)])
    assert status == 400 and says in body["error"]["message"], body
    assert "longer than" not in body["error"]["message"]


def test_wrong_types_and_huge_numbers_over_http_are_400_naming_the_field():
    bodies = [(b'{"model": "gpt-4.1", "messages": [{"role": "user", "content": "x"}], "max_tokens": ' +
               b"9" * 400 + b"}", "max_tokens"),
              (json.dumps({**CHAT, "max_tokens": "7"}).encode(), "max_tokens"),
              (json.dumps({**CHAT, "stream": True, "stream_options": {"include_usage": "no"}}).encode(),
               "stream_options.include_usage")]
    answers = exchange([request("/v1/chat/completions", body, "application/json") for body, _ in bodies])
    for (status, answer), (_, param) in zip(answers, bodies):
        assert status == 400 and answer["error"]["param"] == param, answer


def test_v1_health_needs_no_key_and_everything_else_under_v1_does():
    """/v1/health is for probes (through the public port): no key; /v1/models with no key is 401."""
    answers = exchange([b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"])
    assert answers[0] == (200, {"status": "ok"})
    assert answers[1][0] == 401


def test_a_client_that_leaves_mid_body_leaves_no_traceback(capfd, caplog):
    """The client resets the connection while its body is read: the read raises ConnectionResetError
    in the handler (aiohttp cancels the handler only sometimes first: handler_cancellation is off here,
    so it never does), which aiohttp would log with a traceback as a failed request (issue 33 §1)."""
    import struct

    from aiohttp import web

    from triton_pipelines.openai_api.app import Frontend

    keys = KeyRing.from_document({"keys": [{"key": KEY, "name": "team-a"}]})
    body = json.dumps({"model": "text_embedding", "input": "hi"}).encode()
    bodies = [request("/v1/embeddings", body, "application/json")[:-10],
              multipart_request(b'Content-Disposition: form-data; name="file"; filename="a.wav"')[:-100]]

    def leave(port, raw):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
            connection.sendall(raw)
            time.sleep(0.2)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    async def run():
        frontend = Frontend(None, CATALOG, keys, lambda texts: 0)
        runner = web.AppRunner(frontend.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            for raw in bodies:
                await asyncio.get_running_loop().run_in_executor(None, leave, port, raw)
            await asyncio.sleep(0.3)
            return frontend.metrics.render(), await asyncio.get_running_loop().run_in_executor(
                None, send, port, b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        finally:
            await runner.cleanup()

    metrics, health = asyncio.run(run())
    assert health == (200, {"status": "ok"})
    logged = capfd.readouterr().err + caplog.text  # aiohttp logs to its logger (stderr in the server)
    assert "Traceback" not in logged and "Error handling request" not in logged, logged
    assert 'code="499"' in metrics
