"""A request's decoding job: its tensors validated into windows, prompts and token bounds
(``plan_request``), the windows of a batch's jobs decoded a group at a time (a job whose client
has gone leaves at the next step: ``CancelWatch``), and the transcripts and token ids of
``whisper_decode``'s outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from triton_pipelines.errors import InputError, RequestCancelled, decode_utf8
from triton_pipelines.limits import CLIENT_DEADLINE_PARAMETER
from triton_pipelines.pipelines.speech.config import DEFAULT_LANGUAGE, DEFAULT_MAX_NEW_TOKENS, DEFAULT_TASK, MAX_TARGET_POSITIONS, PROMPT_LENGTH
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer


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


@dataclass
class DecodeJob:
    """One ``whisper_decode`` request: its real windows, their prompts and its token bound."""

    features: np.ndarray  # [windows, n_mels, 3000]
    prompts: np.ndarray  # [windows, 4] int64
    max_new_tokens: np.ndarray  # [windows] int64
    windows_per_item: list[int]
    # Whether its client has gone (cancelled, or past its deadline: ``client_gone``).
    cancelled: Callable[[], bool] = field(default=lambda: False, repr=False, compare=False)


def plan_request(tokenizer: WhisperTokenizer, features: np.ndarray, num_windows: np.ndarray | None,
                 language: np.ndarray | None = None, task: np.ndarray | None = None,
                 max_new_tokens: np.ndarray | None = None, default_language: str = DEFAULT_LANGUAGE,
                 default_task: str = DEFAULT_TASK,
                 default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> DecodeJob:
    """Validate one request's tensors (``features [items, windows, n_mels, 3000]``) → DecodeJob.
    ``max_new_tokens`` may lower the configured bound, never raise it past Whisper's 444."""
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
    prompts = [tokenizer.prompt(lang, t) for lang, t in zip(languages, tasks)]
    if all(count == padded for count in counts):  # no padding windows: a view, not a copy
        windows = features.reshape(-1, *features.shape[2:])
    else:
        windows = np.concatenate([features[i, :counts[i]] for i in range(items)])
    windows = windows.astype(np.float32, copy=False)
    per_window = lambda values: [v for i, v in enumerate(values) for _ in range(counts[i])]  # noqa: E731
    return DecodeJob(windows, np.array(per_window(prompts), dtype=np.int64).reshape(-1, len(prompts[0])),
                     np.array(per_window(bounds), dtype=np.int64), counts)


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
                clock: Callable[[], int] = time.time_ns) -> Callable[[], bool]:
    """A request's "has its client gone?": past its forwarded deadline (an ensemble's running step
    is never cancelled by Triton 2.51) or cancelled (``request.is_cancelled()``: a round trip to the
    server, asked only when the deadline has not passed)."""
    return lambda: deadline_passed(parameters, clock()) or bool(is_cancelled())


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
        window_tokens += decode_group(features[start:stop], prompts[start:stop], bounds[start:stop], on_step)
    result, offset = [], 0
    for index, job in enumerate(jobs):
        count = sum(job.windows_per_item)
        result.append(RequestCancelled("the request's client has gone (cancelled or past its deadline): "
                                       "its decoding stopped") if index in watch.gone
                      else group_windows(window_tokens[offset:offset + count], job.windows_per_item))
        offset += count
    return result


def transcript_outputs(tokenizer: WhisperTokenizer, item_tokens: Sequence[Sequence[list[int]]]) -> dict[str, np.ndarray]:
    """One request's per item, per window ids → ``whisper_decode``'s outputs: ``transcript``
    ``[items, 1]`` (UTF-8 bytes) and ``token_ids`` ``[items, longest]`` int32, padded with -1."""
    texts = [join_transcript(tokenizer, windows) for windows in item_tokens]
    flat = [[t for window in windows for t in window] for windows in item_tokens]
    ids = np.full((len(flat), max(len(f) for f in flat)), -1, dtype=np.int32)
    for row, values in enumerate(flat):
        ids[row, :len(values)] = values
    return {"transcript": np.array([t.encode() for t in texts], dtype=np.object_).reshape(-1, 1), "token_ids": ids}
