"""Unit tests for the text pipeline logic: no server."""

from __future__ import annotations

import numpy as np
import pytest

from repo_builder.text_pipeline import INTENTS_FILE, minilm_dir

from .conftest import PROJECT_ROOT as ROOT
from triton_pipelines.errors import InputError
from triton_pipelines.text import (
    LENGTH_BUCKETS,
    IntentPrototypes,
    TextTokenizer,
    bucket_length,
    decode_texts,
    load_intent_examples,
    mean_pool_normalize,
)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(minilm_dir() / "tokenizer.json")


def as_tensor(*items: bytes) -> np.ndarray:
    return np.array(items, dtype=np.object_).reshape(-1, 1)


def test_decode_texts_accepts_utf8_and_empty_string():
    assert decode_texts(as_tensor("héllo wörld".encode(), b"")) == ["héllo wörld", ""]


def test_decode_texts_names_invalid_utf8_byte_and_position():
    with pytest.raises(InputError, match=r"'text'\[1\] is not valid UTF-8 \(byte 0xff at offset 2\)"):
        decode_texts(as_tensor(b"ok", b"ab\xff"))


def test_decode_texts_refuses_oversized_text():
    with pytest.raises(InputError, match=r"'text'\[0\] is 1048576 bytes; the limit is 65536 bytes"):
        decode_texts(as_tensor(b"a" * (1 << 20)))


def test_decode_texts_refuses_empty_batch():
    with pytest.raises(InputError, match="empty batch"):
        decode_texts(np.zeros((0, 1), dtype=np.object_))


@pytest.mark.parametrize("length,bucket", [(1, 16), (16, 16), (17, 32), (100, 128), (256, 256), (400, 256)])
def test_bucket_length(length, bucket):
    assert bucket_length(length, LENGTH_BUCKETS) == bucket


def test_tokenizer_pads_to_bucket_of_longest_text(tokenizer):
    batch = tokenizer.encode(["hello", "a somewhat longer sentence " * 5])
    assert batch.input_ids.shape == batch.attention_mask.shape == (2, 32)
    assert batch.input_ids.dtype == np.int64
    assert batch.attention_mask[0].sum() == 3  # [CLS] hello [SEP]
    assert batch.input_ids[0, 0] == 101 and batch.input_ids[0, 2] == 102  # BERT [CLS] / [SEP]
    assert (batch.input_ids[0, 3:] == 0).all()


def test_tokenizer_truncates_at_256_tokens(tokenizer):
    batch = tokenizer.encode(["word " * 1000])
    assert batch.input_ids.shape == (1, 256)
    assert batch.attention_mask.sum() == 256
    assert batch.input_ids[0, -1] == 102  # truncation keeps the final [SEP]


def test_tokenizer_matches_transformers_tokenizer(tokenizer):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(minilm_dir()))
    texts = ["Where is my package?", "Ünïcödé and emoji 🙂 text", ""]
    ours = tokenizer.encode(texts)
    for row, text in enumerate(texts):
        expected = reference(text, truncation=True, max_length=256)["input_ids"]
        n = int(ours.attention_mask[row].sum())
        assert ours.input_ids[row, :n].tolist() == expected


def test_mean_pool_ignores_padding_and_normalizes():
    hidden = np.array([[[1.0, 0.0], [3.0, 0.0], [100.0, 100.0]]], dtype=np.float32)
    mask = np.array([[1, 1, 0]])
    pooled = mean_pool_normalize(hidden, mask)
    np.testing.assert_allclose(pooled, [[1.0, 0.0]], atol=1e-7)


def test_mean_pool_matches_sentence_transformers_formula():
    import torch

    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(3, 8, 16)).astype(np.float32)
    mask = np.array([[1] * 8, [1] * 5 + [0] * 3, [1] * 2 + [0] * 6])
    t_hidden, t_mask = torch.from_numpy(hidden), torch.from_numpy(mask).unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((t_hidden * t_mask).sum(1) / t_mask.sum(1).clamp(min=1e-9), dim=1)
    np.testing.assert_allclose(mean_pool_normalize(hidden, mask), expected.numpy(), atol=2e-7)


def test_intent_prototypes_classify_and_roundtrip(tmp_path):
    prototypes = IntentPrototypes.from_examples(
        ["a", "b"], [np.array([[1.0, 0.0], [0.8, 0.2]]), np.array([[0.0, 1.0]])], temperature=0.1)
    labels, scores = prototypes.classify(np.array([[0.9, 0.1], [0.1, 0.9]], dtype=np.float32))
    assert labels == ["a", "b"]
    assert scores.dtype == np.float32 and (scores > 0.5).all() and (scores <= 1).all()
    prototypes.save(tmp_path / "p.npz")
    loaded = IntentPrototypes.load(tmp_path / "p.npz")
    assert loaded.labels == ["a", "b"] and loaded.temperature == pytest.approx(0.1)
    np.testing.assert_array_equal(loaded.vectors, prototypes.vectors)


def test_intent_file_has_the_customer_support_intents():
    examples, temperature = load_intent_examples(ROOT / INTENTS_FILE)
    assert {"password_reset", "billing", "shipping", "cancellation", "technical_support", "greeting"} <= set(examples)
    assert temperature > 0


def test_parse_buckets():
    from triton_pipelines.text import parse_buckets

    assert parse_buckets("64, 16,32") == (16, 32, 64)
    assert parse_buckets("none") == ()


def test_tokenizer_without_buckets_pads_to_longest_text_only():
    tokenizer = TextTokenizer(minilm_dir() / "tokenizer.json", buckets=())
    assert tokenizer.encode(["hello", "hello world"]).input_ids.shape == (2, 4)


def test_ragged_batch_is_padded_and_outputs_trimmed_back(tmp_path):
    """With pad_ragged=True, requests of different lengths run as one padded batch and each
    request gets its own length back; padded positions are masked, so values match solo runs."""
    from pathlib import Path

    from triton_pipelines.onnx_runner import OnnxBatchRunner

    onnx_path = Path(__file__).resolve().parents[1] / "model_repository" / "text_encoder" / "1" / "model.onnx"
    if not onnx_path.exists():
        pytest.skip("model_repository/ not built (make test builds it first)")
    tokenizer = TextTokenizer(minilm_dir() / "tokenizer.json", buckets=())
    short, long = tokenizer.encode(["hi"]), tokenizer.encode(["a much longer request about my order"])
    feeds = [{"input_ids": t.input_ids, "attention_mask": t.attention_mask} for t in (short, long)]
    ragged = OnnxBatchRunner(onnx_path, intra_op_threads=1, pad_ragged=True).run(feeds)
    solo = [OnnxBatchRunner(onnx_path, intra_op_threads=1).run([f])[0] for f in feeds]
    for got, expected, tokens in zip(ragged, solo, (short, long)):
        assert got["last_hidden_state"].shape == expected["last_hidden_state"].shape
        np.testing.assert_allclose(got["last_hidden_state"], expected["last_hidden_state"], atol=1e-4)


def test_exported_encoder_matches_transformers_on_a_padded_mixed_batch():
    """The ONNX file Triton serves equals the torch model it was exported from (dynamic axes:
    another batch size and length than the export's dummy input)."""
    from pathlib import Path

    import torch
    from transformers import BertModel

    from triton_pipelines.onnx_runner import OnnxBatchRunner

    onnx_path = Path(__file__).resolve().parents[1] / "model_repository" / "text_encoder" / "1" / "model.onnx"
    if not onnx_path.exists():
        pytest.skip("model_repository/ not built (make test builds it first)")
    tokens = TextTokenizer(minilm_dir() / "tokenizer.json").encode(
        ["short", "a medium length sentence about billing", "word " * 40])
    (ours,) = OnnxBatchRunner(onnx_path, intra_op_threads=1).run(
        [{"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}])
    model = BertModel.from_pretrained(str(minilm_dir()), add_pooling_layer=False).eval()
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(tokens.input_ids),
                         attention_mask=torch.from_numpy(tokens.attention_mask)).last_hidden_state.numpy()
    mask = tokens.attention_mask.astype(bool)
    np.testing.assert_allclose(ours["last_hidden_state"][mask], expected[mask], atol=1e-4)
