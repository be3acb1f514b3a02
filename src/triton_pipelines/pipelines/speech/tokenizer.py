"""The Whisper tokenizer (tiktoken, offline: ``multilingual.tiktoken`` on disk): prompts, text,
and the logit masks of Whisper's standard suppression."""

from __future__ import annotations

import base64
from functools import cached_property
from pathlib import Path
from typing import Sequence

import numpy as np

from triton_pipelines.errors import InputError
from triton_pipelines.pipelines.speech.config import AUTO_LANGUAGE, DEFAULT_TASK, LANGUAGE_CODES, TASKS
from triton_pipelines.pipelines.speech.timestamps import TimestampRules

# Sentinels in a prompt row (``WhisperTokenizer.prompt_row``): the language slot of a window whose
# language is detected (``detect_from(k)``: from the logits of the window k rows before it in the
# batch, 0 = itself), and the last slot of a window decoded with timestamps (no <|notimestamps|>):
# TIMESTAMPS_SLOT, or WORDS_SLOT for word timestamps too.
TIMESTAMPS_SLOT = -1
WORDS_SLOT = -2
TIMED_SLOTS = (TIMESTAMPS_SLOT, WORDS_SLOT)


def detect_from(k: int) -> int:
    """The language slot of a window that takes the language detected on the window ``k`` rows
    before it (its clip's first window; ``k`` = 0: this window)."""
    return -1 - k


def suppress_mask(vocab_size: int, eot: int, tokens: Sequence[int] = ()) -> np.ndarray:
    """Additive mask over the logits: every special token except ``<|endoftext|>`` is suppressed
    (the prompt already fixed language/task, and timestamps are off), and ``tokens``."""
    mask = np.zeros(vocab_size, dtype=np.float32)
    mask[eot + 1:] = -np.inf
    mask[list(tokens)] = -np.inf
    return mask


class WhisperTokenizer:
    """The multilingual Whisper vocabulary, built exactly as ``whisper/tokenizer.py`` builds it,
    from ``multilingual.tiktoken`` on disk (no download)."""

    def __init__(self, vocab_file: Path | str, num_languages: int = 99):
        import tiktoken

        ranks = {}
        with open(vocab_file) as handle:
            for line in handle:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        self.languages = LANGUAGE_CODES[:num_languages]
        specials = ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{code}|>" for code in self.languages],
                    "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                    "<|notimestamps|>", *[f"<|{i * 0.02:.2f}|>" for i in range(1501)]]
        n_vocab = len(ranks)
        special_tokens = {}
        for token in specials:
            special_tokens[token] = n_vocab
            n_vocab += 1
        self.encoding = tiktoken.Encoding(
            name=Path(vocab_file).name, explicit_n_vocab=n_vocab,
            pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
            mergeable_ranks=ranks, special_tokens=special_tokens)
        self.special = special_tokens
        self.n_vocab = n_vocab
        self.eot = special_tokens["<|endoftext|>"]
        self.sot = special_tokens["<|startoftranscript|>"]
        self.no_timestamps = special_tokens["<|notimestamps|>"]
        self.timestamp_begin = self.no_timestamps + 1
        self.language_tokens = [special_tokens[f"<|{code}|>"] for code in self.languages]

    @classmethod
    def for_vocab_size(cls, vocab_file: Path | str, vocab_size: int) -> "WhisperTokenizer":
        """51865 (tiny ... large-v2: 99 languages) or 51866 (large-v3: 100)."""
        return cls(vocab_file, num_languages=vocab_size - 51865 + 99)

    def prompt(self, language: str = "en", task: str = DEFAULT_TASK) -> list[int]:
        """``<|startoftranscript|><|language|><|task|><|notimestamps|>``; InputError for an unknown
        language code or task."""
        return self.prompt_row(language, task)

    def prompt_row(self, language: str = "en", task: str = DEFAULT_TASK, timestamps: bool | str = False,
                   window: int = 0) -> list[int]:
        """A window's prompt as the 4 slots ``GreedyBatch`` takes: ``language`` ``auto`` (detected:
        the slot ``detect_from(window)``, ``window`` being its index in its clip), ``timestamps``
        (True or ``segment``: the last slot ``TIMESTAMPS_SLOT``, no ``<|notimestamps|>``; ``word``:
        ``WORDS_SLOT``). InputError for an unknown language code or task."""
        if language != AUTO_LANGUAGE and language not in self.languages:
            raise InputError(f"unknown language {language!r}: use a Whisper language code such as 'en', 'de', 'fr', "
                             f"or '{AUTO_LANGUAGE}' to detect it")
        if task not in TASKS:
            raise InputError(f"unknown task {task!r}: use 'transcribe' or 'translate'")
        slot = detect_from(window) if language == AUTO_LANGUAGE else self.special[f"<|{language}|>"]
        last = {True: TIMESTAMPS_SLOT, "segment": TIMESTAMPS_SLOT, "word": WORDS_SLOT}.get(timestamps, self.no_timestamps)
        return [self.sot, slot, self.special[f"<|{task}|>"], last]

    def language_code(self, token: int) -> str:
        return self.languages[token - self.sot - 1]

    def language_mask(self, vocab_size: int) -> np.ndarray:
        """Additive mask keeping only the language tokens: language detection's argmax at the
        ``<|startoftranscript|>`` position (openai-whisper's ``detect_language``)."""
        mask = np.full(vocab_size, -np.inf, dtype=np.float32)
        mask[self.language_tokens] = 0.0
        return mask

    def timestamp_rules(self, vocab_size: int) -> TimestampRules:
        """The masks of a window decoded with timestamps: ``suppress_masks`` with the timestamp
        tokens allowed (openai-whisper and faster-whisper suppress ``<|notimestamps|>`` there)."""
        mask, begin = self.suppress_masks(vocab_size)
        mask, begin = mask.copy(), begin.copy()
        mask[self.timestamp_begin:], begin[self.timestamp_begin:] = 0.0, 0.0
        return TimestampRules(self.timestamp_begin, self.eot, mask, begin)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text)

    @cached_property
    def non_speech_tokens(self) -> tuple[int, ...]:
        """Tokens of symbols that are not speech (music notes, brackets, ...), as openai-whisper's
        ``Tokenizer.non_speech_tokens`` (and faster-whisper's ``suppress_tokens=[-1]``) computes
        them: Whisper never transcribes them by default. Hyphens and quotes stay allowed between
        words, but not at the start of one."""
        symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
        miscellaneous = set("♩♪♫♬♭♮♯")
        result = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in symbols + sorted(miscellaneous):
            for tokens in (self.encode(symbol), self.encode(" " + symbol)):
                if len(tokens) == 1 or symbol in miscellaneous:
                    result.add(tokens[0])
        return tuple(sorted(result))

    def suppress_masks(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The additive logit masks of greedy decoding: every step, and the first generated token
        (which may also not be a blank or ``<|endoftext|>``: Whisper's ``suppress_blank``)."""
        mask = suppress_mask(vocab_size, self.eot, self.non_speech_tokens)
        begin = mask.copy()
        begin[[self.encode(" ")[0], self.eot]] = -np.inf
        return mask, begin

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the text tokens (special tokens dropped)."""
        return self.encoding.decode([int(i) for i in ids if int(i) < self.eot])
