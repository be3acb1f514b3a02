"""Scale-out on one machine: two tritonservers behind the one nginx (``--replicas 2``), round robin
for HTTP and gRPC; retiring one under load (nginx stops sending it requests, then it drains and
stops) fails no request, nor does any graceful nginx reload (each routing change is one); the
metrics carry a ``replica`` label."""

from __future__ import annotations

import os
import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor
from triton_pipelines.server.control import CONTROL_HEADER
from triton_pipelines.server.launcher import start_on_free_ports

from tests.conftest import LOG_DIR, ensure_repository
from tests.support.router_helpers import metric, scrape

MODELS = ["text_embedding", "text_tokenizer", "text_encoder"]


@pytest.fixture(scope="module")
def server():
    launched = start_on_free_ports(ensure_repository(), LOG_DIR / "test-replicas-server.log", models=MODELS,
                                   replicas=2)
    yield launched
    launched.stop()


def served(replica) -> int:
    stats = replica.control.request("/v2/models/text_embedding/stats")["model_stats"]
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats)


class Load:
    """Clients of both protocols sending texts never sent before (computed, not answered by the
    response cache) until ``stop``; what was answered and every failure."""

    def __init__(self, server, protocols=("http", "grpc", "http", "grpc")):
        self.server, self.stopping = server, threading.Event()
        self.answered, self.failures = [], []
        self.threads = [threading.Thread(target=self.send, args=(p,)) for p in protocols]
        for t in self.threads:
            t.start()

    def send(self, protocol):
        client = TritonClient(protocol, self.server.url(protocol))
        nonce = os.urandom(4).hex()
        sent = 0
        while not self.stopping.is_set():
            sent += 1
            try:
                out = client.infer("text_embedding", {"text": text_tensor([f"a parcel that never came {nonce} {sent}"])})
                self.answered.append((protocol, out["embedding"].shape))
            except InferenceServerException as error:
                self.failures.append(f"{protocol}: {error}")
        client.close()

    def stop(self):
        self.stopping.set()
        for t in self.threads:
            t.join()


def test_nginx_reloads_under_load_fail_no_request(server):
    """Each routing change is a graceful nginx reload (SIGHUP): new workers start while the old ones
    finish what they serve. A new worker's idle connection to the in-flight gate (this nginx) that an
    old worker had accepted was closed as that worker exited, and the next POST on it answered 503
    (8 in 160 reloads before the gate was reached without kept-alive connections)."""
    load = Load(server, ("http",) * 4 + ("grpc",) * 2)
    try:
        for _ in range(60):
            server.proxy.process.send_signal(signal.SIGHUP)
            time.sleep(0.2)
        count = len(load.answered)
        time.sleep(1)
        assert len(load.answered) > count
    finally:
        load.stop()
    assert not load.failures, load.failures[:5]
    assert {p for p, _ in load.answered} == {"http", "grpc"}


def test_two_replicas_share_the_traffic_of_both_protocols_and_one_retires_without_a_failure(server):
    assert len(server.replicas) == 2
    before = [served(r) for r in server.replicas]
    load = Load(server)
    try:
        time.sleep(3)
        during = [served(r) - b for r, b in zip(server.replicas, before)]
        assert all(n > 0 for n in during), f"round robin: each replica serves, got {during}"
        status = json.loads((server.state_dir / "server.json").read_text())["status"]
        request = urllib.request.Request(f"http://{status}/v2/replicas/1/retire", data=b"", method="POST",
                                         headers={CONTROL_HEADER: server.key})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert json.loads(response.read()) == {"retired": "1"}
        assert server.replicas[1].process.poll() is not None  # drained and stopped
        count = len(load.answered)
        time.sleep(2)
        assert len(load.answered) > count  # the other replica goes on serving
    finally:
        load.stop()
    assert not load.failures, load.failures[:5]
    assert {p for p, _ in load.answered} == {"http", "grpc"} and {s for _, s in load.answered} == {(1, 384)}
    text = scrape(server.metrics_url)
    assert metric(text, "nv_inference_request_success", model="text_embedding", replica="0") > 0
    assert 'replica="1"' not in text  # a retired replica leaves the metrics
    assert text.count("# TYPE nv_inference_request_success ") == 1


def test_retiring_needs_the_key_and_keeps_one_replica(server):
    status = json.loads((server.state_dir / "server.json").read_text())["status"]
    for headers, expected in (({}, 403), ({CONTROL_HEADER: server.key}, 400)):
        request = urllib.request.Request(f"http://{status}/v2/replicas/0/retire", data=b"", method="POST",
                                         headers=headers)
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request, timeout=30)
        assert error.value.code == expected
    with pytest.raises(urllib.error.HTTPError) as error:  # never routed from the public port
        urllib.request.urlopen(urllib.request.Request(f"http://{server.http_url}/v2/replicas/0/retire", data=b"",
                                                      method="POST", headers={CONTROL_HEADER: server.key}), timeout=30)
    assert error.value.code == 404
