"""The gRPC port's in-flight places through the public ports (issue 33 §2 and §3), on a server of
this module's own with one model, ``sleeper`` (two instances; each request sleeps the seconds it
carries), and a small in-flight limit (16, a client's share 8):

- streams that send only HEADERS (two other addresses, 128 each) hold none of the places: a
  neighbour's ModelInfer calls are served while they are open, and the screen closes them;
- one stream that pushes many requests back to back holds its share, not all of them: a neighbour's
  request waits behind a few of them, and the stream's requests are all served in turn;
- a stream whose request side stays open with nothing flowing while its request runs for longer
  than nginx's 30 s body timeout is answered, not reset."""

from __future__ import annotations

import http.client
import json
import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from triton_pipelines.front.nginx_config import GRPC_SERVICE
from triton_pipelines.limits import STREAM_FIRST_MESSAGE_S
from triton_pipelines.server.launcher import start_on_free_ports

from tests.conftest import LOG_DIR
from tests.support.h2_streams import HeadersOnly

INSTANCES = 2
MAX_INFLIGHT = 16
SLEEPER_CONFIG = f'''name: "sleeper"
backend: "python"
max_batch_size: 0
input [ {{ name: "seconds" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "seconds" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: {INSTANCES} kind: KIND_CPU }} ]
'''
SLEEPER_MODEL = '''
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            seconds = pb_utils.get_input_tensor_by_name(request, "seconds")
            time.sleep(float(seconds.as_numpy()[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("seconds", seconds.as_numpy())]))
        return responses
'''

# Decoupled: two partial responses, then the final one (data and the final flag together).
PARTIALS_CONFIG = '''name: "partials"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "seconds" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "seconds" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''
PARTIALS_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            seconds = pb_utils.get_input_tensor_by_name(request, "seconds").as_numpy()
            for _ in range(2):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("seconds", seconds)]))
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("seconds", seconds)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("places") / "repository"
    (repository / "sleeper" / "1").mkdir(parents=True)
    (repository / "sleeper" / "config.pbtxt").write_text(SLEEPER_CONFIG)
    (repository / "sleeper" / "1" / "model.py").write_text(SLEEPER_MODEL)
    (repository / "partials" / "1").mkdir(parents=True)
    (repository / "partials" / "config.pbtxt").write_text(PARTIALS_CONFIG)
    (repository / "partials" / "1" / "model.py").write_text(PARTIALS_MODEL)
    launched = start_on_free_ports(repository, LOG_DIR / "test-grpc-places-server.log", timeout_s=180,
                                   max_inflight=MAX_INFLIGHT)
    yield launched
    launched.stop()


def sleep_input(seconds: float) -> list:
    tensor = grpcclient.InferInput("seconds", [1], "FP32")
    tensor.set_data_from_numpy(np.array([seconds], np.float32))
    return [tensor]


def grpc_call(server, seconds: float = 0.05) -> str:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.infer("sleeper", sleep_input(seconds), client_timeout=30)
        return "ok"
    except grpcclient.InferenceServerException as error:
        return f"{error.status()}: {error.message()}"
    finally:
        client.close()


def http_call_from(server, source: str, seconds: float) -> int:
    host, port = server.http_url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60, source_address=(source, 0))
    body = json.dumps({"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32", "data": [seconds]}]})
    connection.request("POST", "/v2/models/sleeper/infer", body=body)
    status = connection.getresponse().status
    connection.close()
    return status


def test_streams_that_send_only_headers_hold_no_place(server):
    """Before: 2 addresses x 128 HEADERS-only ModelStreamInfer streams took every place (nginx
    counted each from its HEADERS) and every other client got UNAVAILABLE for 30 s."""
    host, port = server.grpc_url.rsplit(":", 1)
    path = f"/{GRPC_SERVICE}/ModelStreamInfer"
    attackers = [HeadersOnly(host, int(port), path, source, 128) for source in ("127.0.0.2", "127.0.0.3")]
    try:
        time.sleep(1.0)  # every stream has reached nginx (and those within a share, the screen)
        opened = time.monotonic()
        answers = [grpc_call(server) for _ in range(10)]
        assert answers == ["ok"] * 10
        assert time.monotonic() - opened < STREAM_FIRST_MESSAGE_S  # served while the streams are open
        # Each address's streams past its share were refused at once by nginx; the screen closes
        # the rest once they have sent nothing for STREAM_FIRST_MESSAGE_S.
        deadline = time.monotonic() + STREAM_FIRST_MESSAGE_S + 15
        while any(a.ended() < 128 for a in attackers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [a.ended() for a in attackers] == [128, 128]
    finally:
        for attacker in attackers:
            attacker.close()


def test_one_stream_of_many_requests_holds_its_share_not_all_of_them(server):
    """Before: one stream carried any number of requests as one place (60 clips of 7 MB on one
    stream made a neighbour's 1 s transcription take 47 s). Now each request on a stream takes a
    place, and the stream is not read on past its share: a neighbour waits behind a share's worth
    of them, and every request of the stream is still served."""
    count, seconds = 48, 0.25
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(count):
            client.async_stream_infer("sleeper", sleep_input(seconds), request_id=str(i))
        time.sleep(0.5)  # the stream's requests have reached the front
        started = time.monotonic()
        assert http_call_from(server, "127.0.0.2", seconds) == 200
        waited = time.monotonic() - started
        behind_all = count * seconds / INSTANCES
        print(f"the neighbour waited {waited:.2f} s (behind every request of the stream: {behind_all:.1f} s)")
        assert waited < behind_all / 2
        answered = [results.get(timeout=60) for _ in range(count)]
        assert [error for _, error in answered] == [None] * count
        assert sorted(int(result.get_response().id) for result, _ in answered) == list(range(count))
    finally:
        client.stop_stream()
        client.close()


def test_a_stream_waiting_longer_than_nginx_body_timeout_for_its_answer_is_not_reset(server):
    """Before: nginx's client_body_timeout (30 s) applied to a stream whose request side stayed open
    with nothing flowing (tritonclient's start_stream does so while it waits), and the client got
    INTERNAL (RST_STREAM PROTOCOL_ERROR) after 30 s."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        started = time.monotonic()
        client.async_stream_infer("sleeper", sleep_input(35.0))
        result, error = results.get(timeout=90)
        assert error is None, error
        assert result.as_numpy("seconds")[0] == 35.0 and time.monotonic() - started >= 35
    finally:
        client.stop_stream()
        client.close()


def test_a_decoupled_requests_place_is_given_back_with_its_final_response(server):
    """Three times the server's limit of requests to a decoupled model on one stream: each holds
    its place until Triton's final response (tritonserver 2.51 marks the partial ones
    triton_final_response false, the last true), so the stream goes on past its share and every
    request is answered in full."""
    count = 3 * MAX_INFLIGHT
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(count):
            client.async_stream_infer("partials", sleep_input(0.0), request_id=str(i))
        answered = [results.get(timeout=60) for _ in range(3 * count)]
        assert [error for _, error in answered] == [None] * (3 * count)
        marks = [result.get_response().parameters["triton_final_response"].bool_param for result, _ in answered]
        finals = [int(result.get_response().id) for (result, _), final in zip(answered, marks) if final]
        assert sorted(finals) == list(range(count)) and marks.count(False) == 2 * count
    finally:
        client.stop_stream()
        client.close()
