"""The in-process reference: Whisper's encoder and decoder ONNX graphs in ONNX Runtime, decoded by
the same greedy loop as Triton (``decoding.GreedyDecoder``)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from triton_pipelines.pipelines.onnx_runner import onnx_session, run_rows
from triton_pipelines.pipelines.speech.decoding import DecoderShape, GreedyDecoder, cross_names
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer


class WhisperOnnx:
    """In-process reference: the same two ONNX graphs in ONNX Runtime, same greedy state machine.
    Used by the tests (token equality with Triton) and by the benchmark's baseline."""

    def __init__(self, encoder_onnx: Path | str, decoder_onnx: Path | str, intra_op_threads: int = 0,
                 encoder_rows_per_run: int = 0):
        """``encoder_rows_per_run``: as the served encoder's ``rows_per_run`` (1 for ``--whisper-int8``,
        whose result depends on its batch: ``OnnxBatchRunner``); 0 encodes every window at once."""
        self.encoder = onnx_session(encoder_onnx, intra_op_threads)
        self.encoder_rows_per_run = encoder_rows_per_run
        self.decoder = onnx_session(decoder_onnx, intra_op_threads)
        self.shape = DecoderShape.from_sessions(self.encoder, self.decoder)
        self.cross_names = cross_names(self.shape.layers)

    def encode(self, features: np.ndarray) -> dict[str, np.ndarray]:
        outputs = run_rows(self.encoder, self.cross_names, {"input_features": features.astype(np.float32)},
                           self.encoder_rows_per_run)
        return dict(zip(self.cross_names, outputs))

    def decode_windows(self, features: np.ndarray, prompts: np.ndarray, tokenizer: WhisperTokenizer,
                       max_new_tokens: int | np.ndarray) -> list[list[int]]:
        """``features [N, n_mels, 3000]`` and ``prompts [N, 4]`` → generated ids per window."""
        return self.decode_encoded(self.encode(features), prompts, tokenizer, max_new_tokens)

    def decode_encoded(self, cross: dict[str, np.ndarray], prompts: np.ndarray, tokenizer: WhisperTokenizer,
                       max_new_tokens: int | np.ndarray) -> list[list[int]]:
        """Greedy decoding from the encoder's cross K/V (``encode``)."""
        decoder = GreedyDecoder(tokenizer, self.shape.vocab_size, self.step, align=self.align)
        return decoder.decode(prompts, max_new_tokens, cross, self.shape.heads, self.shape.head_dim)

    def detect_language(self, cross: Mapping[str, np.ndarray], tokenizer: WhisperTokenizer) -> list[str]:
        """Each window's language, as openai-whisper's ``detect_language``: one decoder run over
        ``<|startoftranscript|>`` alone, the argmax of the language tokens' logits."""
        rows = len(cross["cross_key_0"])
        past = np.zeros((rows, 2 * self.shape.layers, self.shape.heads, 0, self.shape.head_dim), np.float32)
        logits, _ = self.step(np.full((rows, 1), tokenizer.sot, np.int64), past, cross, {})
        chosen = np.argmax(logits + tokenizer.language_mask(self.shape.vocab_size), axis=-1)
        return [tokenizer.language_code(int(token)) for token in chosen]

    def align(self, input_ids: np.ndarray, past: np.ndarray, cross: Mapping[str, np.ndarray],
              parameters: Mapping[str, str]) -> np.ndarray:
        return self.decoder.run(["alignment_weights"], {"input_ids": input_ids, "past_self_kv": past, **cross})[0]

    def step(self, input_ids: np.ndarray, past: np.ndarray, cross: Mapping[str, np.ndarray],
             parameters: Mapping[str, str]) -> tuple[np.ndarray, np.ndarray]:
        logits, present = self.decoder.run(["logits", "present_self_kv"],
                                           {"input_ids": input_ids, "past_self_kv": past, **cross})
        return logits, present
