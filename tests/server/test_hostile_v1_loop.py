"""One client's bodies do not hold the ``/v1`` frontend's event loop (issue 33 §2), through the
public port of the real server: six hostile bodies at once (16 MiB of `[[]],`, 8 MiB of empty
strings, 8 MiB of line breaks before a multipart boundary), each refused with a 400 in OpenAI's
shape naming its limit, while a neighbour's ``/v1/models`` keeps being answered at once. The
server of ``test_gateway_chat.py`` (router-only, its keys; the frontend runs with every server)."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.server.test_gateway_chat import SECRETS, server, setup  # noqa: F401 - fixtures
from tests.unit.openai_api.test_event_loop import LISTS, PREAMBLE, STRINGS
from triton_pipelines.openai_api import protocol as proto

HOSTILE = [("/v1/chat/completions", LISTS, "application/json"),
           ("/v1/embeddings", STRINGS, "application/json"),
           ("/v1/audio/transcriptions", PREAMBLE + b"--B\r\n", "multipart/form-data; boundary=B")] * 2


def call(url: str, body: bytes | None = None, content_type: str = "application/json") -> tuple[int, dict]:
    import json

    headers = {"Authorization": f"Bearer {SECRETS['open']}", "Content-Type": content_type}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=300) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_neighbour_is_answered_while_six_hostile_bodies_are_refused(server):  # noqa: F811
    base = f"http://{server.http_url}"
    answers: list = [None] * len(HOSTILE)
    waits: list[float] = []

    def hostile(index):
        path, body, content_type = HOSTILE[index]
        answers[index] = call(base + path, body, content_type)

    threads = [threading.Thread(target=hostile, args=(i,)) for i in range(len(HOSTILE))]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads) or len(waits) < 3:
        started = time.perf_counter()
        status, models = call(base + "/v1/models")
        assert status == 200 and models["data"]
        waits.append(time.perf_counter() - started)
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    print(f"\nneighbour: {len(waits)} answers, the slowest in {max(waits):.2f} s")
    for status, body in answers:
        assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}, body
    messages = [body["error"]["message"] for _, body in answers]
    assert sum(f"more than {proto.MAX_JSON_STRUCTURE} JSON values" in m for m in messages) == 4
    assert sum(f"more than {proto.MAX_MULTIPART_PREAMBLE_BYTES} bytes" in m for m in messages) == 2
    assert max(waits) < 2.0, waits  # before: 30 s and more behind the parses


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
