"""``TritonClient.infer_ordered``: many requests at once, answers in request order, matched by the
request id Triton echoes. On the session server, over HTTP and gRPC, against the realtime model
and the throughput class (dynamic batching with preferred batches of 16/32, a 20 ms queue delay and
``preserve_ordering``), with texts of very different lengths (different length buckets, so
different batches that finish at different times); and without a server, with completions
delivered in reverse."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor

WORDS = "my parcel was due yesterday and the tracking page still shows nothing at all".split()
# 12 texts from 2 to ~40 words: token lengths in the buckets 16, 32, 64 and 128.
TEXTS = [" ".join(WORDS[: 1 + (i * 7) % len(WORDS)] * (1 + (i * 3) % 5)) + f" #{i}" for i in range(12)]


@pytest.fixture(scope="module", params=["http", "grpc"])
def ordered_client(request, triton_server) -> TritonClient:
    client = TritonClient(request.param, triton_server.url(request.param), concurrency=8)
    yield client
    client.close()


@pytest.mark.parametrize("model", ["text_embedding", "text_embedding_batch"])
def test_answers_come_back_in_request_order_under_dynamic_batching(ordered_client, model):
    expected = [ordered_client.infer(model, {"text": text_tensor([t])})["embedding"][0] for t in TEXTS]
    answers = ordered_client.infer_ordered(model, [{"text": text_tensor([t])} for t in TEXTS], max_in_flight=4)
    assert len(answers) == len(TEXTS)
    for text, answer, reference in zip(TEXTS, answers, expected):
        np.testing.assert_allclose(answer["embedding"][0], reference, atol=1e-4, err_msg=text)
    # the texts differ, so the embeddings do: a swapped answer could not pass the check above
    assert min(np.abs(expected[i] - expected[i + 1]).max() for i in range(len(TEXTS) - 1)) > 1e-3


def test_a_failed_request_keeps_its_place(ordered_client):
    requests = [{"text": text_tensor([t])} for t in TEXTS[:6]]
    requests[3] = {"text": np.array([[b"caf\xe9"]], dtype=np.object_)}  # not UTF-8: refused with 400
    answers = ordered_client.infer_ordered("text_embedding", requests, return_errors=True)
    assert isinstance(answers[3], InferenceServerException) and "not valid UTF-8" in str(answers[3])
    assert all(isinstance(a, dict) for i, a in enumerate(answers) if i != 3)
    with pytest.raises(InferenceServerException, match="not valid UTF-8"):
        ordered_client.infer_ordered("text_embedding", requests)


class ReversingGrpc:
    """A stand-in for the gRPC client that completes requests in reverse order, from another thread."""

    def __init__(self, count: int):
        self.count = count
        self.calls = []

    def async_infer(self, model, inputs, callback, request_id, outputs=None, parameters=None):
        self.calls.append((request_id, callback))
        if len(self.calls) == self.count:
            threading.Thread(target=self._complete).start()

    def _complete(self):
        for request_id, callback in reversed(self.calls):
            index = int(request_id.rsplit("-", 1)[1])
            result = SimpleNamespace(get_response=lambda rid=request_id: SimpleNamespace(
                id=rid, outputs=[SimpleNamespace(name="value")]), as_numpy=lambda name, i=index: np.array([i]))
            callback(result, None)


def test_completion_order_does_not_matter():
    client = TritonClient.__new__(TritonClient)
    client.protocol, client.concurrency = "grpc", 1
    import tritonclient.grpc as grpcclient

    client.module = grpcclient
    client.client = ReversingGrpc(10)
    answers = client.infer_ordered("m", [{"x": np.array([[i]], np.int32)} for i in range(10)], max_in_flight=10)
    assert [int(a["value"][0]) for a in answers] == list(range(10))
    assert [c[0].rsplit("-", 1)[1] for c in client.client.calls] == [str(i) for i in range(10)]
