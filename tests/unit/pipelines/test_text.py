"""Unit tests for the text pipeline logic: no server."""

from __future__ import annotations

import numpy as np
import pytest

from repo_builder.text_pipeline import INTENTS_FILE, minilm_dir

from tests.conftest import PROJECT_ROOT as ROOT
from triton_pipelines.errors import InputError
from triton_pipelines.pipelines.text import (
    LENGTH_BUCKETS,
    IntentPrototypes,
    TextTokenizer,
    bucket_length,
    decode_texts,
    load_intent_examples,
    mean_pool_normalize,
)
from tests.support.paths import PROJECT_ROOT


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
    from triton_pipelines.pipelines.text import parse_buckets

    assert parse_buckets("64, 16,32") == (16, 32, 64)
    assert parse_buckets("none") == ()


def test_tokenizer_without_buckets_pads_to_longest_text_only():
    tokenizer = TextTokenizer(minilm_dir() / "tokenizer.json", buckets=())
    assert tokenizer.encode(["hello", "hello world"]).input_ids.shape == (2, 4)


def served_encoder_onnx():

    onnx_path = PROJECT_ROOT / "model_repository" / "text_encoder" / "1" / "model.onnx"
    if not onnx_path.exists():
        pytest.skip("model_repository/ not built (make test builds it first)")
    return onnx_path


def length_runs_hold(lengths, grouping):
    runs = grouping.runs(np.asarray(lengths))
    assert sorted(int(row) for run in runs for row in run) == list(range(len(lengths)))  # every row once
    for run in runs:
        members = [lengths[row] for row in run]
        assert members == sorted(members)
        assert len(run) * max(members) <= max(grouping.max_batch_tokens, max(members))  # a lone row may exceed
        assert max(members) <= grouping.max_ratio * min(members) or max(members) <= grouping.short_tokens
    return runs


def test_length_grouping_bounds_padding_and_tokens_per_run():
    from hypothesis import given, settings, strategies as st

    from triton_pipelines.pipelines.onnx_runner import LengthGrouping

    grouping = LengthGrouping(length_input="attention_mask", max_batch_tokens=512)

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.integers(1, 256), min_size=1, max_size=200))
    def check(lengths):
        length_runs_hold(lengths, grouping)

    check()
    # equal lengths fill runs up to the token budget; short rows share one run
    assert [len(run) for run in grouping.runs(np.full(40, 32))] == [16, 16, 8]
    assert len(grouping.runs(np.array([3, 16, 5, 9]))) == 1
    assert [len(run) for run in grouping.runs(np.array([100, 130, 131, 170]))] == [2, 2]


def test_length_grouping_reads_row_lengths_from_the_mask():
    from triton_pipelines.pipelines.onnx_runner import LengthGrouping

    mask = np.array([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert LengthGrouping("attention_mask").row_lengths({"attention_mask": mask}, 5).tolist() == [3, 1, 5, 1]
    assert LengthGrouping(None).row_lengths({"x": mask}, 5).tolist() == [5, 5, 5, 5]


def test_length_grouped_runs_equal_solo_runs_and_keep_each_request_shape():
    """Ragged batching: requests of different lengths (and several texts each) run as length-sorted
    runs; every request gets its own rows back, sequence outputs at its own width, and the values
    of a row alone (padding is masked)."""
    from triton_pipelines.pipelines.onnx_runner import LengthGrouping, OnnxBatchRunner

    onnx_path = served_encoder_onnx()
    tokenizer = TextTokenizer(minilm_dir() / "tokenizer.json", buckets=())
    texts = [["hi"], ["a much longer request about my order and the refund i was promised", "ok"],
             ["word " * 60], ["where is my package", "cancel", "refund please " * 12]]
    feeds = [{"input_ids": t.input_ids, "attention_mask": t.attention_mask} for t in map(tokenizer.encode, texts)]
    grouped = OnnxBatchRunner(onnx_path, intra_op_threads=1,
                              length_grouping=LengthGrouping("attention_mask", max_batch_tokens=64)).run(feeds)
    solo = OnnxBatchRunner(onnx_path, intra_op_threads=1)
    for request, got in zip(feeds, grouped):
        assert got["last_hidden_state"].shape == request["input_ids"].shape + (384,)
        assert got["embedding"].shape == (len(request["input_ids"]), 384)
        for row in range(len(request["input_ids"])):
            length = int(request["attention_mask"][row].sum())
            (alone,) = solo.run([{name: array[row:row + 1, :length] for name, array in request.items()}])
            np.testing.assert_allclose(got["embedding"][row], alone["embedding"][0], atol=1e-5)
            np.testing.assert_allclose(got["last_hidden_state"][row, :length], alone["last_hidden_state"][0],
                                       atol=1e-4)
            assert not got["last_hidden_state"][row, length:].any()


def test_graph_pooling_equals_the_reference_pooling():
    """The encoder's ``embedding`` output (pooling in the ONNX graph) is ``mean_pool_normalize`` of
    its own ``last_hidden_state``, on a padded mixed batch; asking for one output computes only it."""
    from triton_pipelines.pipelines.onnx_runner import OnnxBatchRunner

    tokens = TextTokenizer(minilm_dir() / "tokenizer.json").encode(["short", "a medium length sentence", "x " * 90])
    runner = OnnxBatchRunner(served_encoder_onnx(), intra_op_threads=1)
    (both,) = runner.run([{"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}])
    np.testing.assert_allclose(both["embedding"], mean_pool_normalize(both["last_hidden_state"], tokens.attention_mask),
                               atol=1e-6)
    (only,) = runner.run([{"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}], ["embedding"])
    assert list(only) == ["embedding"]


def test_exported_encoder_matches_transformers_on_a_padded_mixed_batch():
    """The ONNX file Triton serves equals the torch model it was exported from (dynamic axes:
    another batch size and length than the export's dummy input)."""

    import torch
    from transformers import BertModel

    from triton_pipelines.pipelines.onnx_runner import OnnxBatchRunner

    onnx_path = served_encoder_onnx()
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
