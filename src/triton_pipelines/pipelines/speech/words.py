"""Word-level timestamps, as openai-whisper's ``timing.py`` computes them (faster-whisper follows
it): the cross-attention weights of the alignment heads over a window's final tokens
(``whisper_decoder``'s ``alignment_weights``, one extra decoder call per window), normalised per
frame, median-filtered over time, averaged over the heads and aligned to the audio frames by
dynamic time warping; each word starts where the path reaches its first token."""

from __future__ import annotations

import string
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from triton_pipelines.pipelines.speech.config import HOP_LENGTH, SAMPLE_RATE
from triton_pipelines.pipelines.speech.timestamps import Segment
from triton_pipelines.pipelines.speech.vad import TimeMap, as_time_map

TOKENS_PER_SECOND = 50  # encoder positions per second (1500 per 30 s)
MEDIAN_FILTER_WIDTH = 7
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END_MARKS = ".。!！?？"
# Languages written without spaces: words are cut at every decodable character.
NO_SPACE_LANGUAGES = ("zh", "ja", "th", "lo", "my", "yue")
PROMPT_TOKENS = 3  # <|startoftranscript|><|lang|><|task|> before <|notimestamps|> in the aligned sequence


class AlignedTokens(list):
    """A window's generated ids (a plain list to every reader) with the alignment heads'
    cross-attention over its aligned sequence, ``[heads, positions, 1500]``: what ``window_words``
    needs besides the window's length."""

    def __init__(self, tokens: Sequence[int], weights: np.ndarray):
        super().__init__(tokens)
        self.weights = weights


@dataclass
class WordTiming:
    word: str
    tokens: list[int]
    start: float
    end: float
    extra: dict = field(default_factory=dict)


def alignment_sequence(prompt: Sequence[int], tokens: Sequence[int], no_timestamps: int, eot: int) -> list[int]:
    """What the alignment call feeds: ``<|startoftranscript|><|lang|><|task|><|notimestamps|>``, the
    window's text tokens (timestamps left out), ``<|endoftext|>``."""
    return [*prompt[:PROMPT_TOKENS], no_timestamps, *[t for t in tokens if t < eot], eot]


def median_filter(x: np.ndarray, width: int) -> np.ndarray:
    """Median over ``width`` along the last axis, reflect-padded (openai-whisper's)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    return np.median(np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1), axis=-1)


def dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through ``x [N, M]`` from (0, 0) to (N-1, M-1) with steps
    down-right, down and right (openai-whisper's ``dtw_cpu``, its ties included), computed one
    anti-diagonal at a time → (row indices, column indices) along the path."""
    rows, cols = x.shape
    cost = np.full((rows + 1, cols + 1), np.inf, dtype=np.float32)
    trace = -np.ones((rows + 1, cols + 1), dtype=np.int8)
    cost[0, 0] = 0
    x = x.astype(np.float32)
    for diagonal in range(2, rows + cols + 1):
        i = np.arange(max(1, diagonal - cols), min(rows, diagonal - 1) + 1)
        j = diagonal - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        cost[i, j] = x[i - 1, j - 1] + np.choose(step, [c0, c1, c2])
        trace[i, j] = step
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = rows, cols, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        move = trace[i, j]
        if move == 0:
            i, j = i - 1, j - 1
        elif move == 1:
            i -= 1
        else:
            j -= 1
    result = np.array(path[::-1])
    return result[:, 0], result[:, 1]


def split_words(tokens: Sequence[int], decode, eot: int, language: str) -> tuple[list[str], list[list[int]]]:
    """Tokens → words and each word's tokens (openai-whisper's ``split_to_word_tokens``): at every
    decodable run of bytes, and for languages with spaces joined until a space or a punctuation
    mark starts the next one. ``decode``: bytes of ids as text, special tokens as their names."""
    full = decode(list(tokens))
    pieces, piece_tokens, current, offset = [], [], [], 0
    for token in tokens:
        current.append(token)
        text = decode(current)
        if "\ufffd" not in text or full[offset + text.index("\ufffd")] == "\ufffd":
            pieces.append(text)
            piece_tokens.append(current)
            current, offset = [], offset + len(text)
    if language in NO_SPACE_LANGUAGES:
        return pieces, piece_tokens
    words, word_tokens = [], []
    for piece, ids in zip(pieces, piece_tokens):
        if ids[0] >= eot or piece.startswith(" ") or piece.strip() in string.punctuation or not words:
            words.append(piece)
            word_tokens.append(list(ids))
        else:
            words[-1] += piece
            word_tokens[-1].extend(ids)
    return words, word_tokens


def merge_punctuations(alignment: list[WordTiming]) -> None:
    """Opening punctuation joins the next word, closing punctuation the previous one (in place)."""
    i, j = len(alignment) - 2, len(alignment) - 1
    while i >= 0:
        previous, following = alignment[i], alignment[j]
        if previous.word.startswith(" ") and previous.word.strip() in PREPEND_PUNCTUATIONS:
            following.word, following.tokens = previous.word + following.word, previous.tokens + following.tokens
            previous.word, previous.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(alignment):
        previous, following = alignment[i], alignment[j]
        if not previous.word.endswith(" ") and following.word in APPEND_PUNCTUATIONS:
            previous.word, previous.tokens = previous.word + following.word, previous.tokens + following.tokens
            following.word, following.tokens = "", []
        else:
            i = j
        j += 1


def find_alignment(weights: np.ndarray, text_tokens: Sequence[int], samples: int, decode, eot: int,
                   language: str) -> list[WordTiming]:
    """``weights [heads, positions, 1500]`` of ``alignment_sequence`` for a window of ``samples``
    audio samples → each word's start and end in the window (seconds), openai-whisper's
    ``find_alignment``."""
    if not text_tokens:
        return []
    frames = max(1, samples // HOP_LENGTH // 2)
    matrix = weights[:, :, :frames].astype(np.float64)
    matrix = matrix / np.maximum(matrix.sum(axis=-1, keepdims=True), 1e-30)  # the softmax over these frames
    std, mean = matrix.std(axis=-2, keepdims=True), matrix.mean(axis=-2, keepdims=True)
    matrix = median_filter((matrix - mean) / np.maximum(std, 1e-30), MEDIAN_FILTER_WIDTH)
    matrix = matrix.mean(axis=0)[PROMPT_TOKENS:-1]
    text_indices, time_indices = dtw(-matrix)
    words, word_tokens = split_words([*text_tokens, eot], decode, eot, language)
    if len(word_tokens) <= 1:
        return []
    boundaries = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    jump_times = time_indices[jumps] / TOKENS_PER_SECOND
    return [WordTiming(word, tokens, float(start), float(end)) for word, tokens, start, end in
            zip(words, word_tokens, jump_times[boundaries[:-1]], jump_times[boundaries[1:]])]


def window_words(tokens: AlignedTokens, window: TimeMap, decode, eot: int,
                 language: str) -> list[WordTiming]:
    """A window's words with times in the clip: ``find_alignment``, words at sentence ends no
    longer than twice the median word (at most 0.7 s), punctuation merged (openai-whisper's
    ``add_word_timestamps``, before it splits the words among the segments: ``assign_words``)."""
    text_tokens = [t for t in tokens if t < eot]
    window = as_time_map(window)
    samples = window.samples
    alignment = find_alignment(tokens.weights, text_tokens, samples, decode, eot, language)
    durations = np.array([t.end - t.start for t in alignment])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    longest = median * 2
    if len(durations):
        for i in range(1, len(alignment)):
            if alignment[i].end - alignment[i].start > longest:
                if alignment[i].word in SENTENCE_END_MARKS:
                    alignment[i].end = alignment[i].start + longest
                elif alignment[i - 1].word in SENTENCE_END_MARKS:
                    alignment[i].start = alignment[i].end - longest
    merge_punctuations(alignment)
    for timing in alignment:
        # through the window's time map: under VAD a window holds stretches of its clip back to back
        timing.start, timing.end = window.original_time(timing.start), window.original_time(timing.end, is_end=True)
        timing.extra = {"median": median}
    return alignment


def assign_words(segments: list[Segment], alignment: list[WordTiming], last_speech: float
                 ) -> tuple[list[Segment], float]:
    """A window's words shared among its segments by their text tokens, and openai-whisper's
    segment-boundary rules: after a pause the first words are no longer than twice the median
    word; a segment keeps its own start (end) where its first (last) word is too long, else it
    starts (ends) with that word. → the segments with their ``words``, and the end of the speech."""
    median = alignment[0].extra.get("median", 0.0) if alignment else 0.0
    longest = median * 2
    index, result = 0, []
    for segment in segments:
        saved, words = 0, []
        while index < len(alignment) and saved < len(segment.tokens):
            timing = alignment[index]
            if timing.word:
                words.append({"word": timing.word, "start": round(timing.start, 2), "end": round(timing.end, 2)})
            saved += len(timing.tokens)
            index += 1
        start, end = segment.start, segment.end
        if words:
            first = words[0]
            if first["end"] - last_speech > median * 4 and (
                    first["end"] - first["start"] > longest
                    or (len(words) > 1 and words[1]["end"] - first["start"] > longest * 2)):
                if len(words) > 1 and words[1]["end"] - words[1]["start"] > longest:
                    boundary = max(words[1]["end"] / 2, words[1]["end"] - longest)
                    first["end"] = words[1]["start"] = boundary
                first["start"] = max(0, first["end"] - longest)
            if start < first["end"] and start - 0.5 > first["start"]:
                first["start"] = max(0, min(first["end"] - median, start))
            else:
                start = first["start"]
            if end > words[-1]["start"] and end + 0.5 < words[-1]["end"]:
                words[-1]["end"] = max(words[-1]["start"] + median, end)
            else:
                end = words[-1]["end"]
            last_speech = end
        result.append(replace(segment, start=start, end=end, words=tuple(words)))
    return result, last_speech
