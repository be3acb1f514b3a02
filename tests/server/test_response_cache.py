"""Triton's response cache on the session's server (the launcher's default size): identical requests
hit it (texts and images), and its key never conflates two versions, two ``top_k`` values, two
images or two models; error answers
and the router (gateway tasks) are never cached. Over HTTP and gRPC. Which models are built with it:
tests/unit/builder/test_response_cache.py."""

from __future__ import annotations

import json
import urllib.request
import uuid

import numpy as np
import pytest

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor
from triton_pipelines import prometheus_text
from triton_pipelines.pipelines.text import MAX_TEXT_BYTES

from tests.support.paths import PROJECT_ROOT
from tests.support.router_helpers import route

SCENE = (PROJECT_ROOT / "tests" / "data" / "scene.jpg").read_bytes()


def cache_counts(server, model: str) -> tuple[float, float]:
    samples = prometheus_text.parse_samples(prometheus_text.scrape(server.metrics_url))
    return (prometheus_text.total(samples, "nv_cache_num_hits_per_model", model=model),
            prometheus_text.total(samples, "nv_cache_num_misses_per_model", model=model))


def embed(client: TritonClient, model: str, text: str) -> np.ndarray:
    return client.infer(model, {"text": text_tensor([text])})["embedding"]


def unique(tag: str) -> str:
    return f"the cache test {tag} {uuid.uuid4().hex}"


def test_identical_requests_hit_the_cache_and_get_the_same_answer(client, triton_server):
    text = unique(client.protocol)
    hits, misses = cache_counts(triton_server, "text_embedding")
    first = embed(client, "text_embedding", text)
    assert cache_counts(triton_server, "text_embedding") == (hits, misses + 1)
    second = embed(client, "text_embedding", text)
    assert cache_counts(triton_server, "text_embedding") == (hits + 1, misses + 1)
    np.testing.assert_array_equal(first, second)


def test_text_classification_hits_through_its_cached_step(client, triton_server):
    text = unique("classification " + client.protocol)
    first = client.infer("text_classification", {"text": text_tensor([text])})
    hits, _ = cache_counts(triton_server, "text_embedding")
    second = client.infer("text_classification", {"text": text_tensor([text])})
    assert cache_counts(triton_server, "text_embedding")[0] == hits + 1
    assert set(second) == {"label", "score"} and second["label"][0] == first["label"][0]


def test_two_versions_of_the_encoder_keep_their_own_answers(client, triton_server):
    """text_embedding (version 1 of text_encoder, cached) and text_embedding_v2 (the canary, version 2,
    int8, not cached): the same text gets each version's own answer, before and after a hit."""
    text = unique("versions " + client.protocol)
    v1 = embed(client, "text_embedding", text)
    hits, _ = cache_counts(triton_server, "text_embedding")
    np.testing.assert_array_equal(embed(client, "text_embedding", text), v1)
    assert cache_counts(triton_server, "text_embedding")[0] == hits + 1
    v2 = embed(client, "text_embedding_v2", text)
    assert not np.array_equal(v1, v2)
    np.testing.assert_allclose(v1, v2, atol=0.1)  # close: the same model, int8 weights
    np.testing.assert_array_equal(embed(client, "text_embedding_v2", text), v2)
    np.testing.assert_array_equal(embed(client, "text_embedding", text), v1)


def test_models_with_the_same_input_name_keep_their_own_answers(client, triton_server):
    """text_embedding, text_embedding_batch and text_classification all take "text": a text cached
    for one is a miss for the next, which answers with its own outputs."""
    text = unique("models " + client.protocol)
    embedding = embed(client, "text_embedding", text)
    _, misses = cache_counts(triton_server, "text_embedding_batch")
    np.testing.assert_allclose(embed(client, "text_embedding_batch", text), embedding, atol=1e-5)
    assert cache_counts(triton_server, "text_embedding_batch")[1] == misses + 1
    classified = client.infer("text_classification", {"text": text_tensor([text])})
    assert set(classified) == {"label", "score"}


def test_two_top_k_values_get_their_own_answers_from_one_cached_image(client, triton_server):
    """top_k is a request parameter, which Triton's cache key leaves out: the cached step is the
    nested image_logits (the image bytes alone decide it), and the top-k step runs after it on every
    request, so each k gets its own answer, repeated or not, from one computed set of logits."""
    image = np.array([[SCENE + uuid.uuid4().bytes]], dtype=object)  # bytes after the JPEG's end: a new key
    hits, misses = cache_counts(triton_server, "image_logits")
    answers = {}
    for k in (2, 4, 2, 4):
        answer = client.infer("image_classification", {"image": image}, parameters={"top_k": k})
        assert answer["labels"].shape[-1] == k and answer["class_ids"].shape[-1] == k
        if k in answers:
            np.testing.assert_array_equal(answer["scores"], answers[k]["scores"])
            assert answer["labels"].tolist() == answers[k]["labels"].tolist()
        answers[k] = answer
    np.testing.assert_array_equal(answers[4]["class_ids"][..., :2], answers[2]["class_ids"])
    assert cache_counts(triton_server, "image_logits") == (hits + 3, misses + 1)


def test_two_images_keep_their_own_answers_and_a_bad_image_is_never_cached(client, triton_server):
    first = np.array([[SCENE + uuid.uuid4().bytes]], dtype=object)
    other = np.array([[(PROJECT_ROOT / "tests" / "data" / "scene.webp").read_bytes()]], dtype=object)
    one = client.infer("image_classification", {"image": first})
    hits, _ = cache_counts(triton_server, "image_logits")
    for _ in range(2):
        with pytest.raises(InferenceServerException):
            client.infer("image_classification", {"image": np.array([[b"not an image " + uuid.uuid4().bytes]],
                                                                     dtype=object)})
    assert cache_counts(triton_server, "image_logits")[0] == hits
    two = client.infer("image_classification", {"image": other})  # the same scene, another encoding
    assert two["scores"].tolist() != one["scores"].tolist()
    np.testing.assert_array_equal(client.infer("image_classification", {"image": first})["scores"], one["scores"])


def test_an_error_answer_is_never_cached(client, triton_server):
    """A refused text gets the tokenizer's own error every time (an error is not an answer to keep)."""
    too_long = "x" * (MAX_TEXT_BYTES + 1)
    hits, _ = cache_counts(triton_server, "text_embedding")
    for _ in range(2):
        with pytest.raises(InferenceServerException, match=f"the limit is {MAX_TEXT_BYTES} bytes"):
            embed(client, "text_embedding", too_long)
    assert cache_counts(triton_server, "text_embedding")[0] == hits


def test_the_uncached_models_have_no_cache_and_no_cache_metrics(triton_server):
    """The router (its gateway tasks answer per API key and per call), speech, the canary's
    ensembles, the steps: no response_cache in the served config, no cache series."""
    internal = TritonClient("http", triton_server.internal_url("http"))
    try:
        for model in ("router", "speech_recognition", "speech_recognition_stream", "image_classification",
                      "image_preprocess", "text_classification", "text_embedding_v2", "text_encoder", "text_tokenizer"):
            config = internal.client.get_model_config(model)
            assert not config.get("response_cache", {}).get("enable"), model
        samples = prometheus_text.parse_samples(prometheus_text.scrape(triton_server.metrics_url))
        cached = {labels.get("model") for name, labels, _ in samples
                  if name == "nv_cache_num_misses_per_model"}
        # (a cached model's series appear once it has been asked; the session may not have asked all)
        assert {"text_embedding"} <= cached <= {"text_embedding", "text_embedding_batch", "image_logits",
                                                "image_logits_batch"}
        # Triton 2.51 exports no request summary for a cached model; its steps keep theirs
        summarized = {labels.get("model") for name, labels, _ in samples if name == "nv_inference_request_summary_us"}
        assert "text_embedding" not in summarized and {"text_encoder", "text_embedding_v2"} <= summarized
    finally:
        internal.close()


def test_v1_embeddings_are_served_from_the_same_cache(triton_server):
    """/v1/embeddings calls text_embedding: its repeat is a hit, and its answer is the native one."""
    text = unique("v1")
    body = json.dumps({"model": "text_embedding", "input": text}).encode()

    def post() -> list[float]:
        request = urllib.request.Request(f"http://{triton_server.http_url}/v1/embeddings", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["data"][0]["embedding"]

    hits, misses = cache_counts(triton_server, "text_embedding")
    first = post()
    assert cache_counts(triton_server, "text_embedding") == (hits, misses + 1)
    assert post() == first
    assert cache_counts(triton_server, "text_embedding") == (hits + 1, misses + 1)
    native = TritonClient("grpc", triton_server.grpc_url)
    try:
        np.testing.assert_allclose(embed(native, "text_embedding", text)[0], first, atol=1e-6)
    finally:
        native.close()


def test_the_routers_self_hosted_task_hits_the_same_cache(http_client, triton_server):
    """The router's text_embedding task calls text_embedding (version 1) or text_embedding_v2 (the
    canary's share, uncached) by BLS: the version 1 calls after the first are hits, all one answer."""
    text = unique("router")
    hits, _ = cache_counts(triton_server, "text_embedding")
    answers = [route(http_client, "text_embedding", {"text": text}) for _ in range(8)]
    stable = [a["output"]["embedding"] for a in answers if int(a["model_version"]) == 1]
    assert len(stable) >= 2, answers  # 90% of the split goes to version 1
    assert cache_counts(triton_server, "text_embedding")[0] == hits + len(stable) - 1
    assert all(embedding == stable[0] for embedding in stable)
