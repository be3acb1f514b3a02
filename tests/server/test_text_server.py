"""The text pipelines on the real embedded Triton server, over HTTP and gRPC."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor
from triton_pipelines.pipelines.onnx_runner import OnnxBatchRunner
from triton_pipelines.pipelines.text import TextTokenizer, mean_pool_normalize

from tests.conftest import statistics_after

MIXED_LENGTH_TEXTS = [
    "hi",
    "Triton batches requests of different lengths when they share a length bucket.",
    " ".join(["A long customer message about an order that arrived damaged and late."] * 8),
    "",
]


@pytest.fixture(scope="module")
def reference(triton_server):
    """In-process reference: the same tokenizer.json and ONNX file the server loaded, same pooling,
    each text run alone (no bucket padding) so padding handling is checked too."""
    repository = Path(triton_server.options.model_repository)
    tokenizer = TextTokenizer(repository / "text_tokenizer" / "1" / "tokenizer.json", buckets=())
    runner = OnnxBatchRunner(repository / "text_encoder" / "1" / "model.onnx", intra_op_threads=1,
                             output_names=["last_hidden_state"])

    def embed(texts):
        rows = []
        for text in texts:
            tokens = tokenizer.encode([text])
            (out,) = runner.run([{"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}])
            rows.append(mean_pool_normalize(out["last_hidden_state"], tokens.attention_mask)[0])
        return np.stack(rows)

    return embed


def embed(client: TritonClient, texts) -> np.ndarray:
    return client.infer("text_embedding", {"text": text_tensor(texts)})["embedding"]


def test_embedding_matches_in_process_reference_for_mixed_lengths(client, reference):
    embeddings = embed(client, MIXED_LENGTH_TEXTS)
    assert embeddings.shape == (len(MIXED_LENGTH_TEXTS), 384) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    expected = reference(MIXED_LENGTH_TEXTS)
    cosines = (embeddings * expected).sum(axis=1)
    assert (cosines >= 0.9999).all(), cosines


def test_concurrent_requests_of_different_lengths_share_batches(http_client, triton_server, reference):
    """Requests of different lengths are batched by the dynamic batcher (ragged batching on the
    embedded target, one length bucket on the gpu target): the encoder runs fewer executions than
    it serves inferences, and every answer still matches the reference, which runs each text alone."""
    nonce = os.urandom(4).hex()  # texts no earlier test sent: a repeat is answered by the response cache
    texts = [f"question number {i} about my order {nonce}" if i % 2 else f"hello {i} {nonce}" for i in range(48)]
    before = http_client.statistics("text_encoder")["model_stats"][0]
    clients = [TritonClient("grpc", triton_server.grpc_url) for _ in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: embed(clients[i % 16], [texts[i]])[0], range(len(texts))))
    after = statistics_after(http_client, "text_encoder", before, len(texts))
    for c in clients:
        c.close()
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == len(texts)
    assert executions < inferences, (executions, inferences)
    cosines = (np.stack(results) * reference(texts)).sum(axis=1)
    assert (cosines >= 0.9999).all()


def test_ragged_batches_of_many_widths_give_every_row_its_own_answer(triton_server, reference):
    """Ragged batching on the embedded target cuts every row of every request in a batch into runs
    by length and scatters the answers back: big requests of long rows of every width, sent at the
    same time as one-text neighbours, must each get their own rows' embeddings, in order."""
    words = "order delivery refund password invoice account shipping warranty".split()
    long_texts = [" ".join(words[(i + j) % len(words)] for j in range(3 + (i * 37) % 240)) for i in range(64)]
    bulk = [long_texts[k::4] + long_texts[:k] for k in range(4)]  # 4 requests of 17-19 rows, all widths
    short = [f"hello {i}" if i % 2 else f"where is parcel {i}" for i in range(12)]
    jobs = [("bulk", texts) for texts in bulk] + [("short", [text]) for text in short]
    clients = [TritonClient("grpc", triton_server.grpc_url) for _ in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda i: embed(clients[i], jobs[i][1]), range(len(jobs))))
    for c in clients:
        c.close()
    for (_, texts), got in zip(jobs, results):
        assert got.shape == (len(texts), 384)
        cosines = (got * reference(texts)).sum(axis=1)
        assert (cosines >= 0.9999).all(), cosines


def test_paraphrase_ranks_closer_than_unrelated_sentence(client):
    anchor, paraphrase, unrelated = embed(client, [
        "How do I reset my password?",
        "I forgot my password, how can I change it?",
        "The weather in Lisbon is sunny today.",
    ])
    assert anchor @ paraphrase > anchor @ unrelated + 0.2


@pytest.mark.parametrize("utterance,intent", [
    ("I can't remember my password and I'm locked out", "password_reset"),
    ("you billed my card two times this month", "billing"),
    ("my parcel still hasn't been delivered", "shipping"),
    ("please end my subscription, I don't want it anymore", "cancellation"),
    ("the application crashes every time I start it", "technical_support"),
    ("hello there, good afternoon", "greeting"),
])
def test_obvious_utterances_get_the_right_intent(client, utterance, intent):
    outputs = client.infer("text_classification", {"text": text_tensor([utterance])})
    assert outputs["label"].shape == (1, 1) and outputs["score"].shape == (1, 1)
    assert outputs["label"][0, 0].decode() == intent
    assert 0.0 < outputs["score"][0, 0] <= 1.0


def test_classification_batch_agrees_with_its_own_embeddings(client, triton_server):
    """label/score equal the prototype scoring of the embeddings the server returns."""
    from triton_pipelines.pipelines.text import IntentPrototypes

    texts = ["where is my package", "refund the double charge", "hey"]
    prototypes = IntentPrototypes.load(
        Path(triton_server.options.model_repository) / "intent_classifier" / "1" / "intent_prototypes.npz")
    labels, scores = prototypes.classify(embed(client, texts))
    outputs = client.infer("text_classification", {"text": text_tensor(texts)})
    assert [x.decode() for x in outputs["label"][:, 0]] == labels
    np.testing.assert_allclose(outputs["score"][:, 0], scores, atol=1e-5)


def assert_error(client: TritonClient, model: str, inputs: dict, *fragments: str) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.infer(model, inputs)
    message = str(caught.value)
    # A bad input is the client's fault: HTTP 400 / gRPC INVALID_ARGUMENT, never a server error.
    assert str(caught.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("model", ["text_embedding", "text_classification"])
def test_bad_inputs_get_clear_errors_and_the_server_keeps_serving(client, model):
    assert_error(client, model, {"text": text_tensor([b"caf\xe9 au lait"])}, "not valid UTF-8", "0xe9")
    assert_error(client, model, {"text": text_tensor([b"x" * (1 << 20)])}, "1048576 bytes", "limit is 65536")
    assert_error(client, model, {"text": np.zeros((1, 1), dtype=np.int32)}, "text", "INT32", "BYTES")
    assert_error(client, model, {"text": text_tensor(["a", "b"]).reshape(1, 2)}, "text", "shape")
    assert_error(client, model, {"wrong_name": text_tensor(["a"])}, "wrong_name")
    assert_error(client, model, {"text": np.zeros((0, 1), dtype=np.object_)}, "text")
    assert client.infer(model, {"text": text_tensor(["still serving"])})


def test_empty_string_is_a_defined_result(client, reference):
    """Documented: the empty text embeds as the [CLS][SEP] sequence (a unit vector)."""
    np.testing.assert_allclose(embed(client, [""])[0] @ reference([""])[0], 1.0, atol=1e-4)


def test_a_failing_request_does_not_fail_its_batch_neighbours(triton_server):
    good, bad = [f"good request {i}" for i in range(12)], text_tensor([b"\xff\xfe"])
    clients = [TritonClient("grpc", triton_server.grpc_url) for _ in range(12)]

    def call(i):
        c = clients[i]
        if i % 3 == 0:
            with pytest.raises(InferenceServerException, match="not valid UTF-8"):
                c.infer("text_embedding", {"text": bad})
            return None
        return c.infer("text_embedding", {"text": text_tensor([good[i]])})["embedding"]

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(call, range(12)))
    for c in clients:
        c.close()
    assert all(r.shape == (1, 384) for i, r in enumerate(results) if i % 3)


def test_server_and_models_are_healthy_afterwards(client):
    assert client.is_server_ready()
    for model in ("text_tokenizer", "text_encoder", "intent_classifier",
                  "text_embedding", "text_classification"):
        assert client.is_model_ready(model), model


def test_the_encoders_config_carries_the_provenance_of_its_weights(triton_server):
    """/v2/models/text_encoder/config (through the public front) says where the weights came from,
    as .built's model table does."""
    import json
    import urllib.request

    from triton_pipelines.repository.contract import BuiltManifest

    from tests.conftest import ensure_repository

    (row,) = [r for r in BuiltManifest.read(ensure_repository()).model_table if r["model"] == "text_encoder"]
    with urllib.request.urlopen(f"http://{triton_server.http_url}/v2/models/text_encoder/config", timeout=30) as reply:
        config = json.loads(reply.read())
    parameters = {key: value["string_value"] for key, value in config["parameters"].items()}
    assert parameters["weights_kind"] == row["kind"] and parameters["weights_source"] == row["source"]
    assert parameters["weights_sha256"] == ",".join(f"{name}={digest}" for name, digest in row["files"])
    assert parameters["architecture"] == row["architecture"] and "random_weights" not in parameters
