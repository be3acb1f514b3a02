"""Request bytes in flight through the public ports (issue 33 §2, "memory per large in-flight
request"), on a server of this module's own with one model, ``holder`` (four instances; each request
carries a blob of bytes and sleeps the seconds it asks for, answering the blob's size), and a small
byte budget: a body of at most 8 MiB, 24 MiB of request bytes in flight, a client's share 12 MiB.

Before, only the count of requests was bounded: one client could hold 128 places of 64 MiB each
(~36 GB across the screen, tritonserver, a stub and /dev/shm on a 24 GB machine). Now a request
whose bytes do not fit is refused at once (503 / UNAVAILABLE naming the byte budget) on HTTP and
unary gRPC, and a stream's request waits unread until its bytes fit; a neighbour's small requests
are served throughout."""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from triton_pipelines.server.launcher import start_on_free_ports

from tests.conftest import LOG_DIR

MiB = 2**20
MAX_BODY = 8 * MiB
BUDGET, SHARE = 24 * MiB, 12 * MiB
BLOB = 5 * MiB  # two of them fit in a client's share, three do not
HOLDER_CONFIG = '''name: "holder"
backend: "python"
max_batch_size: 0
input [ { name: "blob" data_type: TYPE_UINT8 dims: [ -1 ] },
        { name: "seconds" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "size" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 4 kind: KIND_CPU } ]
'''
HOLDER_MODEL = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            blob = pb_utils.get_input_tensor_by_name(request, "blob").as_numpy()
            time.sleep(float(pb_utils.get_input_tensor_by_name(request, "seconds").as_numpy()[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("size", np.array([blob.size], np.int64))]))
        return responses
'''
REFUSED = "MiB of request bytes in flight"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("request-bytes") / "repository"
    (repository / "holder" / "1").mkdir(parents=True)
    (repository / "holder" / "config.pbtxt").write_text(HOLDER_CONFIG)
    (repository / "holder" / "1" / "model.py").write_text(HOLDER_MODEL)
    launched = start_on_free_ports(repository, LOG_DIR / "test-request-bytes-server.log", timeout_s=180,
                                   max_body_bytes=MAX_BODY, max_inflight_bytes=BUDGET,
                                   max_inflight_bytes_per_client=SHARE)
    yield launched
    launched.stop()


def http_holder(server, source: str, size: int, seconds: float) -> tuple[int, str]:
    """One binary HTTP request from ``source``: (status, the error or the size answered)."""
    header = json.dumps({"inputs": [
        {"name": "blob", "shape": [size], "datatype": "UINT8", "parameters": {"binary_data_size": size}},
        {"name": "seconds", "shape": [1], "datatype": "FP32", "data": [seconds]}]}).encode()
    host, port = server.http_url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60, source_address=(source, 0))
    try:
        connection.request("POST", "/v2/models/holder/infer", body=header + bytes(size),
                           headers={"Inference-Header-Content-Length": str(len(header)),
                                    "Content-Type": "application/octet-stream"})
        response = connection.getresponse()
        answer = json.loads(response.read())
    finally:
        connection.close()
    if response.status != 200:
        return response.status, answer.get("error", "")
    return 200, str(answer["outputs"][0]["data"][0])


def grpc_inputs(size: int, seconds: float) -> list:
    blob = grpcclient.InferInput("blob", [size], "UINT8")
    blob.set_data_from_numpy(np.zeros(size, np.uint8))
    wait = grpcclient.InferInput("seconds", [1], "FP32")
    wait.set_data_from_numpy(np.array([seconds], np.float32))
    return [blob, wait]


class Neighbour:
    """Small HTTP requests from another address, back to back, while an attack runs."""

    def __init__(self, server, source: str = "127.0.0.2"):
        self.answers: list[tuple[int, str, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(server, source), daemon=True)
        self.thread.start()

    def run(self, server, source):
        while not self.stop.is_set():
            started = time.monotonic()
            status, text = http_holder(server, source, 64 * 1024, 0.05)
            self.answers.append((status, text, time.monotonic() - started))

    def finish(self) -> list[tuple[int, str, float]]:
        self.stop.set()
        self.thread.join(30)
        return self.answers


def test_http_requests_past_a_clients_share_of_bytes_are_refused_at_once_and_a_neighbour_is_served(server):
    neighbour = Neighbour(server)
    try:
        with ThreadPoolExecutor(6) as pool:
            started = time.monotonic()
            answers = list(pool.map(lambda _: http_holder(server, "127.0.0.1", BLOB, 3.0), range(6)))
            elapsed = time.monotonic() - started
    finally:
        seen = neighbour.finish()
    served = [a for a in answers if a == (200, str(BLOB))]
    refused = [a for a in answers if a[0] == 503]
    print(f"attacker: {len(served)} served, {len(refused)} refused in {elapsed:.1f} s; neighbour: {len(seen)} requests")
    # a client's share of 12 MiB holds two 5 MiB requests at a time: the others were refused at once
    assert len(served) == 2 and len(refused) == 4, answers
    assert all(REFUSED in text and "this client" in text for _, text in refused)
    assert elapsed < 3.0 * 2  # the refused did not wait for a share
    assert seen and all(status == 200 for status, _, _ in seen), seen[:3]
    assert max(latency for _, _, latency in seen) < 2.0  # never held behind the attacker's bytes


def unary(server, size: int, seconds: float):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        result = client.infer("holder", grpc_inputs(size, seconds), client_timeout=60)
        return "ok", int(result.as_numpy("size")[0])
    except grpcclient.InferenceServerException as error:
        return error.status(), error.message()
    finally:
        client.close()


def test_grpc_unary_requests_past_the_share_are_unavailable_at_once(server):
    with ThreadPoolExecutor(5) as pool:
        started = time.monotonic()
        answers = list(pool.map(lambda _: unary(server, BLOB, 2.0), range(5)))
    assert sorted(a[0] for a in answers) == ["StatusCode.UNAVAILABLE"] * 3 + ["ok"] * 2, answers
    assert all(REFUSED in message for code, message in answers if code != "ok")
    assert time.monotonic() - started < 2.0 * 2


def test_a_streams_request_waits_unread_until_its_bytes_fit_then_is_served(server):
    """nginx bounds a whole stream by the body limit (client_max_body_size counts every message of
    it), so one stream alone never exceeds a share; with the share held by the same client's unary
    calls, the stream's request waits for their bytes instead of being refused."""
    with ThreadPoolExecutor(2) as pool:
        holding = [pool.submit(unary, server, BLOB, 3.0) for _ in range(2)]
        time.sleep(1.0)  # both hold their bytes
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: results.put((time.monotonic(), result, error)))
        try:
            sent = time.monotonic()
            client.async_stream_infer("holder", grpc_inputs(BLOB, 0.1), request_id="waits")
            answered_at, result, error = results.get(timeout=60)
        finally:
            client.stop_stream()
            client.close()
        assert [future.result() for future in holding] == [("ok", BLOB)] * 2
    assert error is None, error
    assert int(result.as_numpy("size")[0]) == BLOB
    assert answered_at - sent >= 1.5  # it waited for the unary calls' bytes (3 s, 1 s of it gone)


def test_a_body_larger_than_the_limit_is_still_refused_by_size_and_the_budget_is_whole_again(server):
    status, text = http_holder(server, "127.0.0.1", MAX_BODY + 1, 0.0)
    assert status == 413, text
    # everything taken before was given back: a share's worth is served again at once
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: http_holder(server, "127.0.0.1", BLOB, 0.5), range(2)))
    assert answers == [(200, str(BLOB))] * 2
