"""Property-based tests of the router's request parsing and handling (hypothesis): whatever bytes a
client sends as ``task``, ``payload`` and ``latency_class``, the router answers with a routed
request or a clean InputError, and the service answers every request without raising."""

from __future__ import annotations

import asyncio
import json
import string

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triton_pipelines.errors import INPUT_REASONS, InputError, UNAVAILABLE_REASONS
from triton_pipelines.gateway.upstream import GatewayClient
from triton_pipelines.pipelines.router.service import RouterService
from triton_pipelines.pipelines.router.router import Router
from triton_pipelines.repository.routes import RoutedRequest, RouteTable
from tests.support.paths import PROJECT_ROOT

TABLE = RouteTable.load(PROJECT_ROOT / "data" / "routes.yaml")
ROUTER = Router(TABLE)
TASKS = sorted(TABLE.tasks)
# Text with lone surrogates (often), controls and non-BMP characters: everything json.dumps writes.
# (st.text() leaves surrogates out, so the strings are joined from characters.)
ANY_TEXT = st.lists(st.one_of(st.characters(codec=None, exclude_categories=()),
                              st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)), max_size=40).map("".join)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | ANY_TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
                    max_leaves=20)
FIELDS = st.sampled_from(["text", "image", "audio", "messages", "tier", "temperature", "max_tokens", "user",
                          "image_mime", "role", "content"])
PAYLOADS = st.one_of(
    JSON.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(FIELDS, JSON, max_size=6).map(lambda d: json.dumps(d).encode()),
    st.dictionaries(FIELDS, ANY_TEXT, min_size=1, max_size=4).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=200),
    st.integers(1, 3000).map(lambda depth: ('{"text": ' + "[" * depth + "]" * depth + "}").encode()),
)


@st.composite
def requests_for_known_tasks(draw):
    """A known task with the payload fields it reads, holding any text or JSON: where parsing bugs hide."""
    task = draw(st.sampled_from(TASKS))
    route = TABLE.tasks[task]
    wanted = list(route.inputs) if route.route == "triton" else draw(st.sampled_from([["text"], ["messages"],
                                                                                      ["text", "image"]]))
    payload = {name: draw(st.one_of(ANY_TEXT, JSON)) for name in wanted}
    payload.update(draw(st.dictionaries(FIELDS, st.one_of(ANY_TEXT, JSON), max_size=3)))
    return task.encode(), json.dumps(payload).encode()


TASK_BYTES = st.one_of(st.sampled_from(TASKS).map(str.encode), st.binary(max_size=30),
                       st.text(string.printable, max_size=20).map(str.encode))
CLASSES = st.one_of(st.none(), st.sampled_from([b"realtime", b"batch", b"", b"urgent"]), st.binary(max_size=10))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=st.one_of(st.tuples(TASK_BYTES, PAYLOADS), requests_for_known_tasks()), latency_class=CLASSES)
def test_prepare_routes_or_refuses_cleanly(request, latency_class):
    task, payload = request
    try:
        routed = ROUTER.prepare(task, payload, latency_class)
    except InputError as error:
        message = str(error)
        assert message and message.encode("utf-8")  # a message that can be sent as it is
        return
    assert isinstance(routed, RoutedRequest) and routed.task in TABLE.tasks
    json.dumps(routed.messages).encode("utf-8")  # what goes upstream is valid Unicode


class Recorder:
    def __init__(self):
        self.reasons = []

    def request(self, task, route, reason, latency_s, routed, completion, cost_usd):
        self.reasons.append(reason)

    def circuit(self, model, open_):
        pass

    def start_at_zero(self, tasks, gateway_models):
        pass


async def echo_triton(target, inputs, outputs, parameters):
    return {name: np.array([[b"ok"]], dtype=np.object_) for name in outputs}


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.one_of(st.tuples(TASK_BYTES, PAYLOADS), requests_for_known_tasks()), min_size=1, max_size=5))
def test_the_service_answers_every_request_and_records_every_row(rows):
    recorder = Recorder()
    service = RouterService(ROUTER, GatewayClient(TABLE.gateway, {}), echo_triton, recorder)
    tasks = np.array([[t] for t, _ in rows], dtype=np.object_)
    payloads = np.array([[p] for _, p in rows], dtype=np.object_)
    answer = asyncio.run(service.handle(tasks, payloads, None, None))
    assert len(recorder.reasons) == len(rows)
    if answer.reason:
        assert answer.reason in INPUT_REASONS | UNAVAILABLE_REASONS  # never "internal": no bug reached
        assert answer.message.encode("utf-8")
    else:
        assert answer.result.shape == (len(rows), 1)
        assert all(json.loads(r[0])["route"] == "triton" for r in answer.result)


def test_a_bug_in_one_row_fails_that_request_as_internal_without_a_traceback():
    recorder = Recorder()
    logged = []

    async def broken_triton(target, inputs, outputs, parameters):
        raise KeyError("/secret/path/model.py")

    service = RouterService(ROUTER, GatewayClient(TABLE.gateway, {}), broken_triton, recorder, logged.append)
    answer = asyncio.run(service.handle(np.array([[b"text_embedding"]], dtype=np.object_),
                                        np.array([[b'{"text": "x"}']], dtype=np.object_), None, None))
    assert answer.reason == "internal" and "KeyError" in answer.message and "/secret" not in answer.message
    assert recorder.reasons == ["internal"] and "Traceback" in logged[0] and "/secret/path" in logged[0]


def test_a_self_hosted_call_carries_the_tasks_deadline_and_the_cancel_board_id():
    """Triton 2.51 never stops a running ensemble step when the router gives up on it (its task's
    deadline) or its client leaves: the BLS request carries both for whisper_decode's loop."""
    import time

    from triton_pipelines.limits import CLIENT_CANCEL_PARAMETER, CLIENT_DEADLINE_PARAMETER

    seen = []

    async def recording_triton(target, inputs, outputs, parameters):
        seen.append(dict(parameters))
        return await echo_triton(target, inputs, outputs, parameters)

    service = RouterService(ROUTER, GatewayClient(TABLE.gateway, {}), recording_triton, Recorder())
    before = time.time_ns()
    answer = asyncio.run(service.handle(np.array([[b"speech_recognition"], [b"text_embedding"]], dtype=np.object_),
                                        np.array([[b'{"audio": "AAAA"}'], [b'{"text": "x"}']], dtype=np.object_),
                                        None, None, None, "ab" * 16))
    assert not answer.reason, answer.message
    deadlines = sorted(int(p[CLIENT_DEADLINE_PARAMETER]) - before for p in seen)
    assert 59e9 <= deadlines[0] <= 61e9 and 299e9 <= deadlines[1] <= 301e9  # text 60 s, speech 300 s (routes.yaml)
    assert all(p[CLIENT_CANCEL_PARAMETER] == "ab" * 16 for p in seen)


def test_a_canary_version_that_is_not_loaded_is_served_by_the_stable_one_and_counted_so():
    """A canary unloaded (or never loaded beside its stable version) costs its share nothing: the
    answer and the canary metric name the version that served it."""
    from triton_pipelines.errors import RouteError

    called = []

    async def stable_only(target, inputs, outputs, parameters):
        called.append(target)
        if target != "text_embedding":
            raise RouteError("not_loaded", f"model {target} is not loaded on this server")
        return await echo_triton(target, inputs, outputs, parameters)

    class Canaries(Recorder):
        def request(self, task, route, reason, latency_s, routed, completion, cost_usd):
            self.reasons.append((reason, routed.model_version, routed.target))

    recorder = Canaries()
    service = RouterService(ROUTER, GatewayClient(TABLE.gateway, {}), stable_only, recorder)
    # a key that the default split (90/10) sends to version 2
    key = next(f"user-{i}" for i in range(1000)
               if ROUTER.prepare(b"text_embedding", b'{"text": "x"}', None, f"user-{i}").model_version == 2)
    answer = asyncio.run(service.handle(np.array([[b"text_embedding"]], dtype=np.object_),
                                        np.array([[b'{"text": "x"}']], dtype=np.object_), None, key))
    assert not answer.reason, answer.message
    result = json.loads(answer.result[0][0])
    assert called == ["text_embedding_v2", "text_embedding"]
    assert (result["served_by"], result["model_version"], result["canary"]["version"]) == ("text_embedding", "1", 1)
    assert "text_embedding_v2 is not loaded" in result["note"]
    assert recorder.reasons == [(None, 1, "text_embedding")]
