"""Text pipeline logic: UTF-8 decoding with limits, tokenizing (into length buckets where the
encoder needs equal shapes), mean pooling, and zero-shot intent scoring against label prototypes.

How mixed lengths share a batch (docs/design.md, "Batching requests of different lengths"):
- embedded target: the encoder takes ragged batches, so the tokenizer pads a request only to its
  own longest text and the encoder's runner groups rows by their own length
  (``onnx_runner.LengthGrouping``, at most ``MAX_BATCH_TOKENS`` padded tokens per run);
- gpu target: the native onnxruntime backend only batches equal shapes, so the tokenizer pads each
  request to the next length bucket (16, 32, ... 256): padding waste under 2x.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from triton_pipelines.limits import MAX_TEXT_BYTES
from triton_pipelines.errors import InputError, as_bytes, decode_utf8
from triton_pipelines.pipelines.scoring import softmax

MAX_SEQUENCE_LENGTH = 256
LENGTH_BUCKETS = (16, 32, 64, 128, 256)
# The embedded encoder's length grouping: padded tokens per ONNX Runtime run (64 rows of 64 tokens,
# 16 of 256). Larger runs gain nothing on a CPU and hold the rows that finish first.
MAX_BATCH_TOKENS = 4096
# A request text larger than this is refused rather than tokenized: tokenizing 1 MB costs ~100 ms
# of a shared CPU for a result truncated to 256 tokens anyway.
# The parameters the builder writes into text_tokenizer's config.pbtxt (the source names none of
# them): these constants are the one place each value lives (docs/design.md, "Change a limit").
# Two depend on what is built, so the builder writes them itself (text_pipeline.TextPipeline.patch_config):
# length_buckets, per target's encoder batching ("none": pad a request to its longest text only, on the
# embedded target; LENGTH_BUCKETS on the gpu target), and max_sequence_length, the served model's own
# truncation (its sentence_bert_config.json ...; MAX_SEQUENCE_LENGTH when its files state none).
CONFIG_PARAMETERS = {
    "text_tokenizer": {"max_text_bytes": MAX_TEXT_BYTES},
}


def decode_texts(raw: np.ndarray, input_name: str = "text", max_bytes: int = MAX_TEXT_BYTES) -> list[str]:
    """Decode a Triton BYTES tensor of shape [batch, 1] (or [batch]) into ``str``.

    Raises InputError naming the offending element for non-UTF-8 or oversized texts and for an
    empty batch.
    """
    flat = raw.reshape(-1)
    if flat.size == 0:
        raise InputError(f"input '{input_name}' is an empty batch: send at least one text")
    texts = []
    for index, item in enumerate(flat):
        data = as_bytes(item)
        if len(data) > max_bytes:
            raise InputError(
                f"input '{input_name}'[{index}] is {len(data)} bytes; the limit is {max_bytes} bytes"
            )
        texts.append(decode_utf8(data, f"input '{input_name}'[{index}]"))
    return texts


def parse_buckets(value: str) -> tuple[int, ...]:
    """"16,32,64" → (16, 32, 64); "none" → () (no buckets: pad to the longest text only)."""
    if value.strip().lower() == "none":
        return ()
    return tuple(sorted(int(v) for v in value.split(",") if v.strip()))


def bucket_length(length: int, buckets: Sequence[int] = LENGTH_BUCKETS) -> int:
    """The smallest bucket that holds ``length``; ``length`` itself when there are no buckets."""
    for bucket in buckets:
        if length <= bucket:
            return bucket
    return buckets[-1] if buckets else length


@dataclass
class TokenBatch:
    input_ids: np.ndarray  # int64 [batch, bucket]
    attention_mask: np.ndarray  # int64 [batch, bucket]


# Tokenizing a 64 KiB text costs ~70 ms, to keep 256 tokens of it. A text is tokenized from a prefix
# of PREFIX_CHARS characters, cut after ASCII whitespace, doubled until it yields max_length tokens
# (then the whole text yields the same tokens: see TextTokenizer.encode) or is the whole text.
PREFIX_CHARS = 4096
_SAFE_CUT = (" ", "\t", "\n", "\r")


def pad_token_id(tokenizer, padding: Mapping | None) -> int:
    """The model's padding id: its tokenizer.json's padding, else ``[PAD]`` (BERT) or ``<pad>``
    (RoBERTa, MPNet), else 0. (Padded positions are masked: the id matters to position ids only.)"""
    for found in ((padding or {}).get("pad_id"), tokenizer.token_to_id("[PAD]"), tokenizer.token_to_id("<pad>")):
        if found is not None:
            return int(found)
    return 0


def _is_bert_wordpiece(tokenizer) -> bool:
    """BertNormalizer + BertPreTokenizer + WordPiece: the pipeline whose prefix property holds."""
    document = json.loads(tokenizer.to_str())
    return ((document.get("normalizer") or {}).get("type") == "BertNormalizer"
            and (document.get("pre_tokenizer") or {}).get("type") == "BertPreTokenizer"
            and document["model"].get("type") == "WordPiece")


class TextTokenizer:
    """Hugging Face ``tokenizers`` over a ``tokenizer.json``, truncating and padding to a bucket."""

    def __init__(self, tokenizer_json: Path | str, max_length: int = MAX_SEQUENCE_LENGTH,
                 buckets: Sequence[int] = LENGTH_BUCKETS, prefix_chars: int | None = PREFIX_CHARS):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        padding = self.tokenizer.padding  # the model's own, before it is turned off here
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=max_length)
        self.max_length = max_length
        self.buckets = tuple(b for b in buckets if b < max_length) + (max_length,) if buckets else ()
        self.pad_id = pad_token_id(self.tokenizer, padding)
        # Another tokenizer pipeline (a user's checkpoint) is tokenized whole.
        self.prefix_chars = prefix_chars if prefix_chars and _is_bert_wordpiece(self.tokenizer) else None

    @classmethod
    def from_parameters(cls, tokenizer_json: Path | str, parameters: Mapping[str, str]) -> "TextTokenizer":
        """As ``text_tokenizer`` is configured: its config parameters (written by the builder)."""
        return cls(tokenizer_json, max_length=int(parameters["max_sequence_length"]),
                   buckets=parse_buckets(parameters["length_buckets"]))

    @classmethod
    def served(cls, model_dir: Path) -> "TextTokenizer":
        """The tokenizer a built ``text_tokenizer`` model folder serves (``model_repository/text_tokenizer``):
        what an in-process reference or baseline must use to tokenize exactly as the served path."""
        from triton_pipelines.repository.contract import built_config_parameters

        return cls.from_parameters(Path(model_dir) / "1" / "tokenizer.json", built_config_parameters(model_dir))

    def _encode_bounded(self, texts: list[str]) -> list:
        """``encode_batch(texts)`` with the cost of a row bounded by the token limit, not its bytes.

        A BERT normalizer works character by character (clean-up, CJK spacing, accents, lowercase)
        and its pre-tokenizer splits words at whitespace, so the tokens of ``text[:cut]``, cut just
        after a whitespace character, are the first tokens of ``text``; when the prefix already
        fills ``max_length`` (after truncation), the whole text gives the same encoding.
        Proven against whole-text tokenization by a property test (tests/unit/pipelines/test_input_budgets.py)."""
        if self.prefix_chars is None:
            return self.tokenizer.encode_batch(texts)
        results: list = [None] * len(texts)
        pending = list(range(len(texts)))
        limit = self.prefix_chars
        while pending:
            parts, whole = [], []
            for index in pending:
                text = texts[index]
                whole.append(len(text) <= limit)
                # cut just after the last whitespace of the first ``limit`` characters ("" if none)
                parts.append(text if whole[-1] else text[:max(text.rfind(c, 0, limit) for c in _SAFE_CUT) + 1])
            encodings = self.tokenizer.encode_batch(parts)
            again = []
            for index, part, encoding, is_whole in zip(pending, parts, encodings, whole):
                if is_whole or len(encoding.ids) >= self.max_length:
                    results[index] = encoding
                else:
                    again.append(index)
            pending, limit = again, limit * 2
            if pending and limit >= max(len(texts[i]) for i in pending):
                for index, encoding in zip(pending, self.tokenizer.encode_batch([texts[i] for i in pending])):
                    results[index] = encoding
                pending = []
        return results

    def encode(self, texts: Sequence[str]) -> TokenBatch:
        """All texts of one request, padded to the bucket of the longest."""
        encodings = self._encode_bounded(list(texts))
        length = bucket_length(max(len(e.ids) for e in encodings), self.buckets)
        input_ids = np.full((len(encodings), length), self.pad_id, dtype=np.int64)
        attention_mask = np.zeros((len(encodings), length), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            n = len(encoding.ids)
            input_ids[row, :n] = encoding.ids
            attention_mask[row, :n] = 1
        return TokenBatch(input_ids, attention_mask)


def mean_pool_normalize(hidden: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Sentence-transformers pooling: mean of token states under the mask, then unit L2 norm.

    ``hidden`` is [batch, length, dim]; ``attention_mask`` is [batch, length].
    """
    mask = attention_mask.astype(np.float32)[..., None]
    summed = (hidden * mask).sum(axis=1)
    counts = np.clip(mask.sum(axis=1), 1e-9, None)
    pooled = summed / counts
    norms = np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
    return (pooled / norms).astype(np.float32)


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Each row at unit L2 norm (a zero row stays zero)."""
    vectors = np.asarray(vectors, np.float32)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)


@dataclass
class IntentPrototypes:
    """One unit vector per intent: the normalized mean of its example phrases' embeddings."""

    labels: list[str]
    vectors: np.ndarray  # float32 [num_intents, dim], unit rows
    temperature: float

    @classmethod
    def from_examples(cls, labels: Sequence[str], example_embeddings: Sequence[np.ndarray],
                      temperature: float) -> "IntentPrototypes":
        vectors = np.stack([unit_rows(np.asarray(e, np.float32)).mean(axis=0) for e in example_embeddings])
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        return cls(list(labels), vectors.astype(np.float32), float(temperature))

    def save(self, path: Path) -> None:
        np.savez(path, labels=np.array(self.labels), vectors=self.vectors,
                 temperature=np.float32(self.temperature))

    @classmethod
    def load(cls, path: Path) -> "IntentPrototypes":
        data = np.load(path)
        return cls([str(label) for label in data["labels"]], data["vectors"].astype(np.float32),
                   float(data["temperature"]))

    def classify(self, embeddings: np.ndarray) -> tuple[list[str], np.ndarray]:
        """Best intent per row and its probability: softmax over cosine / temperature (the rows are
        normalized here: a model without a Normalize module embeds at any length)."""
        probabilities = softmax(unit_rows(embeddings) @ self.vectors.T / self.temperature)
        best = probabilities.argmax(axis=1)
        return [self.labels[i] for i in best], probabilities[np.arange(len(best)), best]

    def outputs(self, embeddings: np.ndarray) -> dict[str, np.ndarray]:
        """The ``intent_classifier`` outputs: ``label`` (BYTES) and ``score``, both ``[batch, 1]``."""
        labels, scores = self.classify(embeddings)
        return {"label": np.array(labels, dtype=np.object_).reshape(-1, 1), "score": scores.reshape(-1, 1)}


def load_intent_examples(path: Path) -> tuple[dict[str, list[str]], float]:
    """Read ``data/intents.yaml``: ``{temperature: float, intents: {label: [phrases]}}``."""
    import yaml

    document = yaml.safe_load(Path(path).read_text())
    intents = document["intents"]
    if not intents or any(not phrases for phrases in intents.values()):
        raise ValueError(f"{path}: every intent needs at least one example phrase")
    return {str(k): [str(p) for p in v] for k, v in intents.items()}, float(document["temperature"])
