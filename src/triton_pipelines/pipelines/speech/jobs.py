"""A request's decoding job: its tensors validated into windows, prompts and token bounds
(``plan_request``), the windows of a batch's jobs decoded a group at a time (a job whose client
has gone leaves at the next step: ``CancelWatch``), and the transcripts and token ids of
``whisper_decode``'s outputs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from triton_pipelines.cancel_board import CancelBoard
from triton_pipelines.errors import InputError, RequestCancelled, decode_utf8
from triton_pipelines.limits import CLIENT_CANCEL_PARAMETER, CLIENT_DEADLINE_PARAMETER
from triton_pipelines.pipelines.speech.config import (DEFAULT_LANGUAGE, DEFAULT_MAX_NEW_TOKENS, DEFAULT_TASK, DEFAULT_TIMESTAMPS,
                                                     MAX_TARGET_POSITIONS, PROMPT_LENGTH, SAMPLE_RATE, TIMESTAMP_MODES,
                                                     WINDOW_SAMPLES)
from triton_pipelines.pipelines.speech.decoding import fill_languages
from triton_pipelines.pipelines.speech.timestamps import window_segments
from triton_pipelines.pipelines.speech.words import AlignedTokens, assign_words, window_words
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer
from triton_pipelines.pipelines.speech.vad import TimeMap


def group_windows(window_tokens: Sequence[list[int]], windows_per_item: Sequence[int]) -> list[list[list[int]]]:
    """Flat per-window token lists → per item, that item's windows."""
    result, start = [], 0
    for count in windows_per_item:
        result.append(list(window_tokens[start:start + count]))
        start += count
    return result


def text_values(raw: np.ndarray | None, count: int, input_name: str, default: str) -> list[str]:
    """An optional ``[items, 1]`` BYTES input → one lower-cased string per item (the default where
    the input is absent or an element is empty)."""
    if raw is None:
        return [default] * count
    flat = raw.reshape(-1)
    if flat.size != count:
        raise InputError(f"input '{input_name}' has {flat.size} elements for {count} audio items")
    return [decode_utf8(item, f"input '{input_name}'[{index}]").strip().lower() or default
            for index, item in enumerate(flat)]


def timestamp_values(raw: np.ndarray | None, count: int, default: str) -> list[str]:
    """The optional ``timestamps`` input (``none`` | ``segment`` | ``word``; BOOL true/false too:
    segment/none) → per item, its mode."""
    if raw is not None and raw.dtype == np.bool_:
        flags = raw.reshape(-1)
        if flags.size != count:
            raise InputError(f"input 'timestamps' has {flags.size} elements for {count} audio items")
        return ["segment" if flag else "none" for flag in flags]
    modes = text_values(raw, count, "timestamps", default)
    for index, mode in enumerate(modes):
        if mode not in TIMESTAMP_MODES:
            raise InputError(f"input 'timestamps'[{index}] is {mode!r}: use one of {', '.join(TIMESTAMP_MODES)}")
    return modes


def item_spans(raw: np.ndarray | None, counts: Sequence[int]) -> list[list[TimeMap]]:
    """The optional ``window_spans [items, rows, 3]`` (``audio_features``' output: one row (window,
    start, end) per stretch of its clip a window holds, seconds; padding rows window -1) → per item,
    per window, its time map; without it, 30 s windows end to end."""
    if raw is None:
        return [[TimeMap([(i * WINDOW_SAMPLES, (i + 1) * WINDOW_SAMPLES)]) for i in range(count)] for count in counts]
    rows = raw.reshape(len(counts), -1, 3) if raw.size else np.zeros((len(counts), 0, 3))
    maps = []
    for item, count in enumerate(counts):
        spans: list[list[tuple[int, int]]] = [[] for _ in range(count)]
        for window, start, end in rows[item]:
            if 0 <= window < count:
                spans[int(window)].append((int(round(start * SAMPLE_RATE)), int(round(end * SAMPLE_RATE))))
        if any(not window for window in spans):
            raise InputError(f"input 'window_spans'[{item}] maps {sum(map(bool, spans))} of its {count} windows")
        maps.append([TimeMap(window) for window in spans])
    return maps


@dataclass
class DecodeJob:
    """One ``whisper_decode`` request: its real windows, their prompts and its token bound, and
    each item's window spans in its clip (seconds)."""

    features: np.ndarray  # [windows, n_mels, 3000]
    prompts: np.ndarray  # [windows, 4] int64: GreedyBatch's slots (detected languages written in)
    max_new_tokens: np.ndarray  # [windows] int64
    windows_per_item: list[int]
    spans: list[list[TimeMap]] = field(default_factory=list)
    # Whether its client has gone (cancelled, or past its deadline: ``client_gone``).
    cancelled: Callable[[], bool] = field(default=lambda: False, repr=False, compare=False)


def plan_request(tokenizer: WhisperTokenizer, features: np.ndarray, num_windows: np.ndarray | None,
                 language: np.ndarray | None = None, task: np.ndarray | None = None,
                 max_new_tokens: np.ndarray | None = None, timestamps: np.ndarray | None = None,
                 window_spans: np.ndarray | None = None, default_language: str = DEFAULT_LANGUAGE,
                 default_task: str = DEFAULT_TASK, default_timestamps: str = DEFAULT_TIMESTAMPS,
                 default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> DecodeJob:
    """Validate one request's tensors (``features [items, windows, n_mels, 3000]``) → DecodeJob.
    ``max_new_tokens`` may lower the configured bound, never raise it past Whisper's 444. A
    language ``auto`` (the default) is detected on each item's first window."""
    items, padded = features.shape[0], features.shape[1]
    counts = [padded] * items if num_windows is None else [int(c) for c in num_windows.reshape(-1)]
    # 0: an item without speech (audio_features' VAD), decoded to an empty transcript.
    if len(counts) != items or any(c < 0 or c > padded for c in counts):
        raise InputError(f"input 'num_windows' must hold one count in 0..{padded} per item, got {counts}")
    limit = MAX_TARGET_POSITIONS - PROMPT_LENGTH
    bounds = [min(default_max_new_tokens, limit)] * items
    if max_new_tokens is not None:
        values = max_new_tokens.reshape(-1)
        if values.size != items or not all(1 <= int(v) <= limit for v in values):
            raise InputError(f"input 'max_new_tokens' must hold one value in 1..{limit} per item, "
                             f"got {values.tolist()}")
        bounds = [int(v) for v in values]
    languages = text_values(language, items, "language", default_language)
    tasks = text_values(task, items, "task", default_task)
    timed = timestamp_values(timestamps, items, default_timestamps)
    prompts = [tokenizer.prompt_row(lang, t, stamp, window) for lang, t, stamp, count in zip(languages, tasks, timed, counts)
               for window in range(count)]
    if all(count == padded for count in counts):  # no padding windows: a view, not a copy
        windows = features.reshape(-1, *features.shape[2:])
    else:
        windows = np.concatenate([features[i, :counts[i]] for i in range(items)])
    windows = windows.astype(np.float32, copy=False)
    per_window = lambda values: [v for i, v in enumerate(values) for _ in range(counts[i])]  # noqa: E731
    # [-1, 4]: a request without windows (no speech under VAD) still shares its batch's arrays
    return DecodeJob(windows, np.array(prompts, dtype=np.int64).reshape(-1, PROMPT_LENGTH),
                     np.array(per_window(bounds), dtype=np.int64), counts, item_spans(window_spans, counts))


def join_transcript(tokenizer: WhisperTokenizer, tokens: Sequence[list[int]]) -> str:
    """Windows' texts, stripped and joined by one space."""
    return " ".join(text for text in (tokenizer.decode(t).strip() for t in tokens) if text)


def decode_group_size(decoder_max_batch: int, encoder_max_batch: int) -> int:
    """Windows ``whisper_decode`` decodes together: one encoder call's worth, on both targets. On
    the gpu target the encoder's outputs are device tensors, handed to the decoder as they are
    (Python can neither join nor slice them). On the embedded target joining several calls' CPU
    outputs would buy a larger decoder batch, but the decoder's step costs per window about the
    same at 4 and 8 windows on a CPU (docs/speech.md), while the join is a fresh copy of 37 MB
    per window in whisper_decode, and the larger group a larger copy into the decoder's cache."""
    return min(decoder_max_batch, encoder_max_batch)


# How often a request's cancellation is asked for while it decodes (a decoder step of Whisper
# base takes ~20-60 ms on a CPU, a few ms on a GPU).
CANCEL_CHECK_S = 0.1


def deadline_passed(parameters: Mapping[str, Any], now_ns: int) -> bool:
    """Whether the client's deadline the screen forwarded (``limits.CLIENT_DEADLINE_PARAMETER``: ns
    since the epoch, a string) has passed; False without one."""
    value = parameters.get(CLIENT_DEADLINE_PARAMETER)
    try:
        return value is not None and now_ns >= int(value)
    except (TypeError, ValueError):
        return False


def client_gone(parameters: Mapping[str, Any], is_cancelled: Callable[[], bool],
                clock: Callable[[], int] = time.time_ns, board: CancelBoard | None = None) -> Callable[[], bool]:
    """A request's "has its client gone?": past its forwarded deadline (an ensemble's running step
    is never cancelled by Triton 2.51), marked on the screen's cancel ``board`` (an HTTP client that
    hung up, a gRPC call cancelled: ``cancel_board.py``) or cancelled (``request.is_cancelled()``: a
    round trip to the server, asked only when neither said so)."""
    request_id = parameters.get(CLIENT_CANCEL_PARAMETER) if board is not None else None
    return lambda: (deadline_passed(parameters, clock()) or (request_id is not None and board.marked(request_id))
                    or bool(is_cancelled()))


class CancelWatch:
    """Whether each request's client has gone: ``cancelled(index)`` asked at most every
    ``interval`` per request (each question may be a round trip from the stub to the server);
    once gone, gone."""

    def __init__(self, cancelled: Callable[[int], bool], interval: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cancelled = cancelled
        self.interval = CANCEL_CHECK_S if interval is None else interval
        self.clock = clock
        self.gone: set[int] = set()
        self.checked: dict[int, float] = {}

    def __call__(self, index: int) -> bool:
        now = self.clock()
        if index not in self.gone and now - self.checked.get(index, -1e18) >= self.interval:
            self.checked[index] = now
            if self.cancelled(index):
                self.gone.add(index)
        return index in self.gone


def decode_jobs(jobs: Sequence[DecodeJob], group_size: int, decode_group: Callable[..., list[list[int]]],
                watch: CancelWatch | None = None) -> list[list[list[list[int]]] | RequestCancelled]:
    """Every window of every job, decoded ``group_size`` windows at a time by
    ``decode_group(features, prompts, max_new_tokens, on_step)`` → per job, per item, per window:
    the ids. A job whose client has gone (``watch``, by default each job's ``cancelled``) gets no
    more steps: its windows leave the group at the next step, a group of only such windows is not
    decoded, and its result is ``RequestCancelled``."""
    watch = watch or CancelWatch(lambda index: jobs[index].cancelled())
    # One request per batch (the common case at low load) needs no copy of its windows.
    join = lambda arrays: arrays[0] if len(arrays) == 1 else np.concatenate(arrays)  # noqa: E731
    features = join([job.features for job in jobs])
    prompts = join([job.prompts for job in jobs])
    bounds = join([job.max_new_tokens for job in jobs])
    owner = np.repeat(np.arange(len(jobs)), [len(job.features) for job in jobs])  # window → job
    window_tokens: list[list[int]] = []
    for start in range(0, len(features), group_size):
        stop = min(start + group_size, len(features))
        if all(watch(int(index)) for index in set(owner[start:stop].tolist())):
            window_tokens += [[] for _ in range(start, stop)]
            continue

        def on_step(state, start=start, stop=stop):
            gone = [row for row in range(stop - start) if watch(int(owner[start + row]))]
            if gone:
                state.stop(gone)
        fill_languages(prompts, start, stop)
        window_tokens += decode_group(features[start:stop], prompts[start:stop], bounds[start:stop], on_step)
    result, offset = [], 0
    for index, job in enumerate(jobs):
        count = sum(job.windows_per_item)
        if job.prompts is not prompts:
            job.prompts[:] = prompts[offset:offset + count]  # the detected languages
        result.append(RequestCancelled("the request's client has gone (cancelled or past its deadline): "
                                       "its decoding stopped") if index in watch.gone
                      else group_windows(window_tokens[offset:offset + count], job.windows_per_item))
        offset += count
    return result


def item_languages(tokenizer: WhisperTokenizer, prompts: np.ndarray, windows_per_item: Sequence[int]) -> list[str]:
    """Each item's language code (given, or detected on its first window), from its prompts."""
    firsts = np.cumsum([0, *windows_per_item[:-1]])
    # an item without windows (no speech under VAD) has no language
    return [tokenizer.language_code(int(prompts[first, 1])) if count and prompts[first, 1] >= 0 else ""
            for first, count in zip(firsts, windows_per_item)]


def segments_json(tokenizer: WhisperTokenizer, windows: Sequence[list[int]], spans: Sequence[TimeMap],
                  language: str = "") -> str:
    """An item's segments (``timestamps.window_segments`` of each window) as JSON; a window aligned
    for word times (``words.AlignedTokens``) gives each segment its ``words`` too."""
    segments, last_speech = [], 0.0
    for tokens, span in zip(windows, spans):
        found = window_segments(tokens, span, tokenizer.timestamp_begin, tokenizer.decode)
        if isinstance(tokens, AlignedTokens):
            timings = window_words(tokens, span, tokenizer.encoding.decode, tokenizer.eot, language)
            found, last_speech = assign_words(found, timings, last_speech)
        segments += [segment.as_dict() for segment in found]
    return json.dumps(segments, ensure_ascii=False)


def text_column(values: Sequence[str]) -> np.ndarray:
    return np.array([value.encode() for value in values], dtype=np.object_).reshape(-1, 1)


def transcript_outputs(tokenizer: WhisperTokenizer, item_tokens: Sequence[Sequence[list[int]]],
                       job: DecodeJob | None = None) -> dict[str, np.ndarray]:
    """One request's per item, per window ids → ``whisper_decode``'s outputs: ``transcript``
    ``[items, 1]`` (UTF-8 bytes) and ``token_ids`` ``[items, longest]`` int32, padded with -1;
    with its job also ``detected_language`` (each item's code: given or detected; not ``language``,
    which would be the ensemble's input tensor too) and ``segments`` (JSON, ``segments_json``)."""
    texts = [join_transcript(tokenizer, windows) for windows in item_tokens]
    flat = [[t for window in windows for t in window] for windows in item_tokens]
    ids = np.full((len(flat), max(len(f) for f in flat)), -1, dtype=np.int32)
    for row, values in enumerate(flat):
        ids[row, :len(values)] = values
    outputs = {"transcript": text_column(texts), "token_ids": ids}
    if job is not None:
        languages = item_languages(tokenizer, job.prompts, job.windows_per_item)
        outputs["detected_language"] = text_column(languages)
        outputs["segments"] = text_column([segments_json(tokenizer, windows, spans, language)
                                           for windows, spans, language in zip(item_tokens, job.spans, languages)])
    return outputs
