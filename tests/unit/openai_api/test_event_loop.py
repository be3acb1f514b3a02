"""The ``/v1`` event loop is not held by work a client chooses (issue 33 §2): a JSON body's
structure is bounded before it is parsed (``protocol.json_structure``), each endpoint has its body
limit, and a multipart body's preamble is bounded (``multipart.BoundedPreamble``). The protocol's
checks directly, and the aiohttp application (``app.Frontend``, no Triton: every hostile request
is refused before it) over loopback sockets, with a neighbour's request timed while six hostile
bodies are in flight."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from triton_pipelines.openai_api import protocol as proto

from tests.support.loopback_frontend import KEY, with_frontend

MIB = 1 << 20
# Valid JSON within the chat body limit whose parse costs seconds (6.7 million lists).
LISTS = b'{"model": "gpt-4.1", "messages": [' + b"[[]]," * ((16 * MIB - 64) // 5) + b'[]]}'
STRINGS = b'{"model": "text_embedding", "input": [' + b'"",' * ((8 * MIB - 64) // 3) + b'""]}'
PREAMBLE = b"\n" * (8 * MIB)


def error_of(call, *args) -> proto.OpenAIError:
    with pytest.raises(proto.OpenAIError) as caught:
        call(*args)
    return caught.value


def test_the_structure_of_legal_bodies_is_far_below_the_limit():
    embeddings = json.dumps({"model": "text_embedding", "input": ["a, b, [c] {d}" * 300] * 2048}).encode()
    assert proto.json_structure(embeddings) < 3 * 2048  # the commas inside the texts are not counted
    chat = {"model": "gpt-4.1", "messages": [{"role": "user", "content": [{"type": "text", "text": "x,y"}]}] * 256,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20)}}}}] * 64}
    assert proto.json_structure(json.dumps(chat).encode()) < 10_000
    assert proto.json_structure(b'{"text": "' + b'\\",[{' * 200_000 + b'"}') < 10  # escaped quotes are text


@pytest.mark.parametrize("body", [LISTS, STRINGS, b"[" + b"1," * 4 * MIB + b"1]",
                                  b'{"a": [' + b'{"b": {}},' * 200_000 + b'{}]}'],
                         ids=["lists", "strings", "numbers", "objects"])
def test_a_body_of_too_many_values_is_400_before_it_is_parsed(body):
    started = time.perf_counter()
    error = error_of(proto.parse_json_body, body)
    assert time.perf_counter() - started < 2.0  # json.loads of LISTS alone takes 4-14 s
    assert (error.status, error.code) == (400, "request_too_complex")
    assert f"more than {proto.MAX_JSON_STRUCTURE} JSON values" in error.message


def serve(requests_and_checks) -> dict:
    """A loopback Frontend (keys on, no Triton); ``requests_and_checks`` run in threads against its
    port; returns what they stored."""
    results: dict = {}
    with_frontend(lambda port: requests_and_checks(port, results))
    return results


def post(path: str, body: bytes, content_type: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nAuthorization: Bearer {KEY}\r\n\r\n").encode() + body


def exchange(port: int, raw: bytes, timeout_s: float = 60) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as connection:
        try:
            connection.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed before the whole body was sent: read the answer
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


HOSTILE = [post("/v1/chat/completions", LISTS, "application/json"),
           post("/v1/embeddings", STRINGS, "application/json"),
           post("/v1/audio/transcriptions", PREAMBLE + b"--B\r\n", "multipart/form-data; boundary=B")] * 2
NEIGHBOUR = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()


def test_a_neighbour_is_answered_at_once_while_six_hostile_bodies_are_refused():
    def attack(port, results):
        answers, waits = [None] * len(HOSTILE), []

        def hostile(index):
            answers[index] = exchange(port, HOSTILE[index])
        threads = [threading.Thread(target=hostile, args=(i,)) for i in range(len(HOSTILE))]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            started = time.perf_counter()
            status, body = exchange(port, NEIGHBOUR)
            assert status == 200 and body["data"]
            waits.append(time.perf_counter() - started)
            time.sleep(0.02)
        for thread in threads:
            thread.join()
        results.update(answers=answers, waits=waits)

    results = serve(attack)
    for status, body in results["answers"]:
        assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}, body
    messages = [body["error"]["message"] for _, body in results["answers"]]
    assert sum(f"more than {proto.MAX_JSON_STRUCTURE} JSON values" in m for m in messages) == 4
    assert sum(f"more than {proto.MAX_MULTIPART_PREAMBLE_BYTES} bytes come before the first" in m
               for m in messages) == 2
    print(f"neighbour: {len(results['waits'])} answers, the slowest in {max(results['waits']):.3f} s")
    assert max(results["waits"]) < 1.5, results["waits"]  # before: 10-40 s behind the parses


def test_each_endpoint_has_its_body_limit_named_in_the_answer():
    embeddings = b'{"model": "text_embedding", "input": "' + b"a" * proto.MAX_EMBEDDINGS_BODY_BYTES + b'"}'

    def check(port, results):
        results["embeddings"] = exchange(port, post("/v1/embeddings", embeddings, "application/json"))
    (status, body) = serve(check)["embeddings"]
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert f"/v1/embeddings is {proto.MAX_EMBEDDINGS_BODY_BYTES} bytes" in body["error"]["message"]


def test_a_multipart_body_without_a_preamble_or_with_a_short_one_is_read():
    body = (b'--B\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-9\r\n'
            b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nxx\r\n--B--\r\n')

    def check(port, results):
        results["plain"] = exchange(port, post("/v1/audio/transcriptions", body, "multipart/form-data; boundary=B"))
        results["preamble"] = exchange(port, post("/v1/audio/transcriptions", b"a preamble\r\n" + body,
                                                  "multipart/form-data; boundary=B"))
    results = serve(check)
    for status, answer in results.values():  # read to the end: the model named is unknown
        assert status == 404 and "whisper-9" in answer["error"]["message"], answer
