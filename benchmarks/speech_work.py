"""The speech work the FastAPI peer and the in-process limit share: the served Whisper ONNX files,
features, greedy decoding of a batch of 30 s windows, transcripts; and the benchmark's clip."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from triton_pipelines.pipelines.speech.features import audio_to_features, load_mel_filters
from triton_pipelines.pipelines.speech.jobs import join_transcript
from triton_pipelines.pipelines.speech.reference import WhisperOnnx
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer

LANGUAGE = "en"
# About 10 s of English speech (espeak-ng): three sentences of the quality tests' corpus.
CLIP_SENTENCES = 3


def clip() -> bytes:
    from tools.speech_eval import CORPUS, speak

    english = [s.text for s in CORPUS if s.language == LANGUAGE][:CLIP_SENTENCES]
    return speak(" ".join(english), LANGUAGE)


class Whisper:
    def __init__(self, repository: Path, threads: int):
        self.model = WhisperOnnx(repository / "whisper_encoder" / "1" / "model.onnx",
                                 repository / "whisper_decoder" / "1" / "model.onnx", intra_op_threads=threads)
        self.filters = load_mel_filters(repository / "audio_features" / "1" / "mel_filters.npz", self.model.shape.n_mels)
        self.tokenizer = WhisperTokenizer.for_vocab_size(repository / "whisper_decode" / "1" / "multilingual.tiktoken",
                                                         self.model.shape.vocab_size)

    def features(self, wav: bytes, index: int = 0) -> np.ndarray:
        """[windows, n_mels, 3000] of one clip."""
        return audio_to_features(wav, self.filters, index)

    def transcribe(self, clips: Sequence[np.ndarray], max_new_tokens: Sequence[int]) -> list[tuple[str, list[int]]]:
        """Every window of every clip greedily decoded as one batch → (transcript, token ids) per clip."""
        windows = np.concatenate(list(clips))
        budgets = np.repeat(np.asarray(max_new_tokens, np.int64), [len(c) for c in clips])
        prompts = np.array([self.tokenizer.prompt(LANGUAGE)] * len(windows))
        tokens = self.model.decode_windows(windows, prompts, self.tokenizer, budgets)
        answers, position = [], 0
        for c in clips:
            mine = tokens[position:position + len(c)]
            position += len(c)
            answers.append((join_transcript(self.tokenizer, mine), [t for w in mine for t in w]))
        return answers
