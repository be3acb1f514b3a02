"""Whisper's timestamp tokens: the rules greedy decoding applies to them (openai-whisper's
``ApplyTimestampRules``, which CTranslate2 and so faster-whisper apply too), and a window's tokens
→ segments with times in the clip.

Timestamp tokens ``<|0.00|>`` … ``<|30.00|>`` follow ``<|notimestamps|>`` in the vocabulary, one per
``TIME_PRECISION`` (0.02 s). A window decoded with timestamps (its prompt has no
``<|notimestamps|>``) produces ``<|t0|> text <|t1|><|t1'|> text <|t2|> … <|endoftext|>``: each
segment opened and closed by a timestamp, in order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from triton_pipelines.pipelines.speech.vad import TimeMap, as_time_map

TIME_PRECISION = 0.02  # seconds per timestamp token (30 s / 1500 encoder positions)
# The first timestamp of a window may not be later than this (openai-whisper's and faster-whisper's
# default max_initial_timestamp).
MAX_INITIAL_TIMESTAMP = 1.0
MAX_INITIAL_TIMESTAMP_INDEX = int(round(MAX_INITIAL_TIMESTAMP / TIME_PRECISION))


def _logsumexp(values: np.ndarray) -> float:
    top = float(values.max()) if values.size else -np.inf
    if not np.isfinite(top):
        return top
    return top + float(np.log(np.exp(values - top).sum()))


@dataclass(frozen=True)
class TimestampRules:
    """Which tokens are timestamps and the additive masks of a timestamped window (Whisper's
    standard suppression with the timestamp tokens allowed; ``begin``: the first generated token,
    also no blank and no ``<|endoftext|>``)."""

    timestamp_begin: int
    eot: int
    mask: np.ndarray  # [vocab]
    begin: np.ndarray  # [vocab]

    def apply(self, row: np.ndarray, generated: Sequence[int]) -> None:
        """One row of masked logits (``mask`` or ``begin`` already added), in place, given the
        tokens this window generated so far: openai-whisper's ``ApplyTimestampRules``.

        - timestamps come in pairs (a segment's end, the next one's start), except directly before
          ``<|endoftext|>``: after two timestamps comes text; after text then one timestamp, another
          timestamp or ``<|endoftext|>``;
        - timestamps never decrease, and a segment is not empty (its end is after its start);
        - the first token is a timestamp of at most ``MAX_INITIAL_TIMESTAMP``;
        - where the timestamps together are more probable than the best text token, a timestamp."""
        begin, eot = self.timestamp_begin, self.eot
        last_was = len(generated) >= 1 and generated[-1] >= begin
        penultimate_was = len(generated) < 2 or generated[-2] >= begin
        if last_was:
            if penultimate_was:
                row[begin:] = -np.inf
            else:
                row[:eot] = -np.inf
        stamps = [t for t in generated if t >= begin]
        if stamps:
            last = stamps[-1] if last_was and not penultimate_was else stamps[-1] + 1
            row[begin:last] = -np.inf
        if not generated:
            row[:begin] = -np.inf
            row[begin + MAX_INITIAL_TIMESTAMP_INDEX + 1:] = -np.inf
        total = _logsumexp(row)
        if not np.isfinite(total):
            return
        if _logsumexp(row[begin:]) - total > float(row[:begin].max()) - total:
            row[:begin] = -np.inf


@dataclass(frozen=True)
class Segment:
    """A stretch of a transcript: its times in the clip (seconds), text and token ids."""

    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()
    words: tuple[dict, ...] | None = None  # [{word, start, end}] where word times were asked for

    def as_dict(self) -> dict:
        found = {"start": round(self.start, 3), "end": round(self.end, 3), "text": self.text, "tokens": list(self.tokens)}
        if self.words is not None:
            found["words"] = list(self.words)
        return found


def window_segments(tokens: Sequence[int], window: TimeMap, timestamp_begin: int,
                    decode: Callable[[Sequence[int]], str]) -> list[Segment]:
    """One window's generated ids → its segments. With timestamp tokens: one segment per pair
    (start = the clip's time of the opening timestamp, end = of the closing one, through the
    window's time map: under VAD a window holds stretches of its clip back to back); text after
    the last timestamp ends at the window's end. Without: the whole window, one segment. Empty
    texts are left out."""
    window = as_time_map(window)
    offset, end = window.start, window.end
    if not any(t >= timestamp_begin for t in tokens):
        text = decode(tokens).strip()
        return [Segment(offset, end, text, tuple(tokens))] if text else []
    length = window.duration

    def at(token: int, is_end: bool = False) -> float:
        return min(end, window.original_time(min(length, (token - timestamp_begin) * TIME_PRECISION), is_end))
    segments, start, body = [], None, []

    def close(stop: float) -> None:
        text = decode(body).strip()
        if text:
            segments.append(Segment(start, max(start, stop), text, tuple(body)))

    for token in tokens:
        if token < timestamp_begin:
            if start is None:  # text without an opening timestamp (cannot happen under the rules)
                start = offset if not segments else segments[-1].end
            body.append(token)
        elif start is None:
            start, body = at(token), []
        else:
            close(at(token, is_end=True))
            start, body = None, []
    if start is not None and body:
        close(end)
    return segments
