"""The router on the real embedded server (the session server), over HTTP and gRPC: self-hosted
tasks give the same answer as their ensemble called directly, latency classes reach their
configurations, the canary split lands on its share and moves at run time, metrics count it.
The image/speech tests run when those ensembles are in the repository under test."""

from __future__ import annotations

import os
import base64
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor
from triton_pipelines.pipelines.onnx_runner import OnnxBatchRunner
from triton_pipelines.pipelines.text import TextTokenizer, mean_pool_normalize

from tests.support.router_helpers import metric, route, scrape
from tests.support.paths import TEST_DATA

TEXTS = ["I want a refund for my order", "my password does not work anymore", "hi"]
DATA = TEST_DATA


@pytest.fixture(scope="module")
def repository(triton_server) -> Path:
    return Path(triton_server.options.model_repository)


@pytest.fixture
def split_file(repository):
    """Writes the router's run-time split file; removed afterwards (defaults come back)."""
    path = repository / "router" / "splits.json"

    def write(shares: dict[int, float]):
        path.write_text(json.dumps({"text_encoder": {str(v): s for v, s in shares.items()}}))

    yield write
    path.unlink(missing_ok=True)


def assert_same_outputs(actual: dict, expected: dict[str, np.ndarray]):
    assert set(actual) == set(expected)
    for name, array in expected.items():
        row = array[0]
        if array.dtype == np.object_:
            values = [v.decode() for v in row.reshape(-1)]
            assert actual[name] == (values[0] if len(values) == 1 else values)
        else:
            got = np.asarray(actual[name], dtype=array.dtype).reshape(row.shape)
            np.testing.assert_allclose(got, row, rtol=0, atol=1e-5)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("latency_class", ["realtime", "batch"])
@pytest.mark.parametrize("task", ["text_embedding", "text_classification"])
def test_text_task_matches_its_ensemble(client, split_file, task, latency_class, version):
    split_file({version: 100})
    for index, text in enumerate(TEXTS):
        result = route(client, task, {"text": text}, latency_class)
        expected_target = task + ("_batch" if latency_class == "batch" else "") + ("_v2" if version == 2 else "")
        assert (result["task"], result["route"], result["model"], result["model_version"]) == (
            task, "triton", task, str(version))
        assert result["served_by"] == expected_target and result["latency_class"] == latency_class
        assert result["canary"] == {"model": "text_encoder", "version": version} and result["usage"] == {}
        assert_same_outputs(result["output"], client.infer(expected_target, {"text": text_tensor([text])}))
        if version == 1:  # version 1 is exactly what the plain ensemble serves
            assert_same_outputs(result["output"], client.infer(task, {"text": text_tensor([text])}))


def test_canary_version_2_is_the_int8_model(http_client, repository, split_file):
    """Version 2 answers match an in-process run of text_encoder/2/model.onnx (int8), and differ
    from version 1's."""
    tokenizer = TextTokenizer.served(repository / "text_tokenizer")
    runner = OnnxBatchRunner(repository / "text_encoder" / "2" / "model.onnx", intra_op_threads=1)
    split_file({2: 100})
    for text in TEXTS:
        tokens = tokenizer.encode([text])
        (out,) = runner.run([{"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}])
        expected = mean_pool_normalize(out["last_hidden_state"], tokens.attention_mask)[0]
        got = np.array(route(http_client, "text_embedding", {"text": text})["output"]["embedding"], np.float32)
        np.testing.assert_allclose(got, expected, atol=1e-5)
        stable = http_client.infer("text_embedding", {"text": text_tensor([text])})["embedding"][0]
        assert np.abs(got - stable).max() > 1e-4


def test_latency_classes_reach_their_configurations(http_client, split_file):
    realtime = http_client.client.get_model_config("text_encoder")
    batch = http_client.client.get_model_config("text_encoder_batch")
    assert batch["dynamic_batching"]["preferred_batch_size"] == [16, 32]
    assert batch["dynamic_batching"]["max_queue_delay_microseconds"] == 20000
    assert batch["dynamic_batching"]["preserve_ordering"] is True
    assert realtime["dynamic_batching"].get("max_queue_delay_microseconds", 0) == 0
    assert not realtime["dynamic_batching"].get("preserve_ordering", False)
    assert realtime["version_policy"] == batch["version_policy"] == {"specific": {"versions": [1, 2]}}
    split_file({1: 100})

    def count(model):
        return sum(s["inference_count"] for s in http_client.statistics(model)["model_stats"])

    before = {m: count(m) for m in ("text_encoder", "text_encoder_batch")}
    nonce = os.urandom(4).hex()  # a text sent again would be answered by the response cache
    for i, latency_class in enumerate(("batch", "batch", "batch", "realtime")):
        route(http_client, "text_embedding", {"text": f"route me {i} {nonce}"}, latency_class)
    after = {m: count(m) for m in ("text_encoder", "text_encoder_batch")}
    assert after["text_encoder_batch"] - before["text_encoder_batch"] == 3
    assert after["text_encoder"] - before["text_encoder"] == 1


def run_split(triton_server, count: int, key) -> list[int]:
    local = threading.local()

    def one(i):
        if not hasattr(local, "client"):
            local.client = TritonClient("grpc", triton_server.grpc_url)
        payload, request_id = key(i)
        return int(route(local.client, "text_embedding", payload, request_id=request_id)["model_version"])

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(count)))


def test_canary_split_lands_on_its_share_and_moves_at_run_time(triton_server, http_client, split_file):
    def served(version):
        return sum(s["inference_count"] for s in http_client.statistics("text_encoder")["model_stats"]
                   if s["version"] == str(version))

    labels = {"task": "text_embedding", "model": "text_encoder"}
    split_file({1: 90, 2: 10})
    metrics_before, v2_before = scrape(triton_server.metrics_url), served(2)
    versions = run_split(triton_server, 1000, lambda i: ({"text": f"canary {i % 7}"}, f"request-{i}"))
    share = versions.count(2) / len(versions)
    assert abs(share - 0.10) <= 0.03, share
    metrics_after = scrape(triton_server.metrics_url)
    # The served version is in the metric and is what Triton ran: text_encoder version 2's own count.
    assert (metric(metrics_after, "router_canary_requests_total", **labels, version="2")
            - metric(metrics_before, "router_canary_requests_total", **labels, version="2")) == versions.count(2)
    assert served(2) - v2_before == versions.count(2)

    split_file({1: 50, 2: 50})  # run time, no reload: the router re-reads the file when it changes
    moved = run_split(triton_server, 1000, lambda i: ({"text": f"canary {i % 7}", "user": f"user-{i}"}, ""))
    assert abs(moved.count(2) / len(moved) - 0.50) <= 0.03, moved.count(2)
    # Sticky: the same user key gets the same version again.
    again = run_split(triton_server, 50, lambda i: ({"text": "again", "user": f"user-{i}"}, ""))
    assert again == moved[:50]


@pytest.mark.parametrize("payload, latency_class, fragment", [
    ('{"text": ', None, "payload is not valid JSON"),
    ({"text": ["a"]}, None, "payload field 'text' must be a string, not list"),
    ({"words": "a"}, None, "task text_classification needs payload field 'text'"),
    ({"text": "a"}, "urgent", "latency_class must be one of realtime, batch"),
    ({"text": "x" * (8 << 20)}, None, "the limit is 8388608 bytes"),
])
def test_bad_input_gets_a_400_and_others_are_unaffected(triton_server, client, payload, latency_class, fragment):
    other = TritonClient(client.protocol, triton_server.url(client.protocol))
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(route, other, "text_classification", {"text": "refund please"})
        with pytest.raises(InferenceServerException) as error:
            route(client, "text_classification", payload, latency_class)
        assert good.result()["output"]["label"]
    assert fragment in str(error.value)
    assert "400" in str(error.value) or "INVALID_ARGUMENT" in str(error.value)


def test_unknown_task_lists_the_known_ones(client):
    with pytest.raises(InferenceServerException, match="unknown task 'summarize'; known tasks: bulk_llm, "
                                                       "code_generation, general_llm, image_classification"):
        route(client, "summarize", {"text": "x"})


def test_gateway_tasks_answer_not_configured_without_the_variables(client):
    if "LLM_GATEWAY_BASE_URL" in __import__("os").environ:
        pytest.skip("this shell sets LLM_GATEWAY_BASE_URL: the session server has a gateway")
    with pytest.raises(InferenceServerException) as error:
        route(client, "general_llm", {"text": "hello"})
    assert "not configured: set LLM_GATEWAY_BASE_URL and LLM_GATEWAY_API_KEY" in str(error.value)
    assert "503" in str(error.value) or "UNAVAILABLE" in str(error.value)


def test_request_metrics_count_successes_and_failures(triton_server, http_client):
    before = scrape(triton_server.metrics_url)
    route(http_client, "text_classification", {"text": "where is my parcel"})
    with pytest.raises(InferenceServerException):
        route(http_client, "text_classification", {"text": 1})
    with pytest.raises(InferenceServerException):
        route(http_client, "no_such_task", {"text": "x"})
    after = scrape(triton_server.metrics_url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("router_requests_total", task="text_classification", route="triton", outcome="success") == 1
    assert delta("router_requests_total", task="text_classification", route="triton", outcome="error") == 1
    assert delta("router_failures_total", task="text_classification", route="triton", reason="invalid_input") == 1
    assert delta("router_failures_total", task="unknown", route="none", reason="invalid_input") == 1
    assert delta("router_upstream_latency_seconds_count", task="text_classification", route="triton") == 1


# ----------------------------------------------------------------- image / speech (when built)
def require(client: TritonClient, model: str):
    try:
        ready = client.is_model_ready(model)
    except InferenceServerException:
        ready = False
    if not ready:
        pytest.skip(f"{model} is not in the repository under test")


def sample(name: str) -> bytes:
    path = DATA / name
    if not path.exists():
        pytest.skip(f"tests/data/{name} is missing")
    return path.read_bytes()


@pytest.mark.parametrize("latency_class", ["realtime", "batch"])
@pytest.mark.parametrize("task,field,sample_file,outputs", [
    ("image_classification", "image", "scene.jpg", ["labels", "scores", "class_ids"]),
    # speech's batch class batches in its BLS decode loop: whisper_decode_batch (docs/speech.md)
    ("speech_recognition", "audio", "speech_hello.wav", ["transcript"]),
])
def test_binary_task_through_the_router_matches_its_ensemble(client, latency_class, task, field, sample_file,
                                                            outputs):
    require(client, task)
    data = sample(sample_file)
    result = route(client, task, {field: base64.b64encode(data).decode()}, latency_class)
    target = task + ("_batch" if latency_class == "batch" else "")
    assert result["served_by"] == target and result["route"] == "triton"
    assert_same_outputs(result["output"], client.infer(target, {field: text_tensor([data])}, outputs=outputs))


def test_task_whose_ensemble_is_not_loaded_gets_a_clear_error(client, triton_server):
    """Unload image_classification (both classes) for a moment: the router answers 503 naming it."""
    names = ["image_classification", "image_classification_batch"]
    for name in names:
        triton_server.control.unload(name)
    try:
        for latency_class in ("realtime", "batch"):
            with pytest.raises(InferenceServerException) as error:
                route(client, "image_classification", {"image": base64.b64encode(b"data").decode()}, latency_class)
            assert "model image_classification is not loaded on this server" in str(error.value)
            assert "503" in str(error.value) or "UNAVAILABLE" in str(error.value)
    finally:
        for name in names:
            triton_server.control.load(name)
    assert all(client.is_model_ready(name) for name in names)