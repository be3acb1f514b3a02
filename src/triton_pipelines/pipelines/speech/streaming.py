"""Streaming partial transcripts (``speech_recognition_stream``): the stable prefix of a
transcript while windows decode, its deltas, and the decoding of one ``execute``'s requests with
a response whenever a request's prefix grows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from triton_pipelines.errors import InputError, as_bytes
from triton_pipelines.pipelines.speech.decoding import GreedyBatch, fill_languages
from triton_pipelines.pipelines.speech.audio import decode_audio
from triton_pipelines.pipelines.speech.features import audio_windows, vad_arguments, vad_modes
from triton_pipelines.pipelines.speech.config import SAMPLE_RATE
from triton_pipelines.pipelines.speech.vad import SileroVad, TimeMap
from triton_pipelines.pipelines.speech.jobs import CancelWatch, item_languages, plan_request, segments_json
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer


def stable_prefix(window_texts: Sequence[str], finished: Sequence[bool]) -> str:
    """The part of a transcript that can be streamed while windows are still decoding: the windows
    in order up to and including the first unfinished one (a later window's text would come out of
    order). Texts are stripped and joined by one space, as the final transcript is; a trailing
    partial character (U+FFFD of an incomplete UTF-8 token) is held back."""
    parts = []
    for text, done in zip(window_texts, finished):
        text = text.strip()
        if not done:
            text = text.rstrip("\ufffd").rstrip()
        if text:
            parts.append(text)
        if not done:
            break
    return " ".join(parts)


def text_delta(sent: str, now: str) -> str:
    """What to send after ``sent`` to reach ``now``: the new suffix, or "" when ``now`` does not
    extend ``sent`` (it will when the window finishes; the final text is sent whole anyway)."""
    return now[len(sent):] if now.startswith(sent) and len(now) > len(sent) else ""


@dataclass
class StreamJob:
    """One ``speech_recognition_stream`` request: its windows, their time maps in the audio, prompts
    (``GreedyBatch``'s slots, one row per window) and token bound, and whether it wants partial
    transcripts."""

    features: np.ndarray  # [windows, n_mels, 3000]
    spans: list[TimeMap]
    prompts: np.ndarray  # [windows, 4] int64
    max_new_tokens: int
    partials: bool = True
    duration: float = 0.0  # the clip's length in seconds (its windows may leave out its silence)


def stream_outputs(transcript: str, delta: str, final: bool, segments: str = "[]",
                   language: str = "", duration: float = 0.0) -> dict[str, np.ndarray]:
    """One response of ``speech_recognition_stream`` (a batch of one item); ``duration``: the
    clip's length in seconds (final responses only)."""
    return {"transcript": np.array([[transcript.encode()]], dtype=np.object_),
            "delta": np.array([[delta.encode()]], dtype=np.object_),
            "is_final": np.array([[final]], dtype=bool),
            "segments": np.array([[segments.encode()]], dtype=np.object_),
            "detected_language": np.array([[language.encode()]], dtype=np.object_),
            "duration": np.array([[duration]], dtype=np.float32)}


class StreamDecode:
    """The windows of every request of one ``execute`` decoded together (as ``whisper_decode``
    does: one encoder pass per group, one decoder step per group for every running window), with a
    partial transcript sent to a request whenever its stable prefix (``stable_prefix``) grows, and
    one final response with the transcript, its segments (one per window, with its times, or one
    per timestamp pair for a request with timestamps) and its language (given or detected).

    ``send(index, outputs, final)`` answers request ``index``; ``cancelled(index)`` says whether its
    client has gone: its windows then stop decoding (they leave the batch at the next step) and it
    gets no more responses except the final, empty one that closes it."""

    def __init__(self, tokenizer: WhisperTokenizer, jobs: Sequence[StreamJob | None], group_size: int,
                 decode_group: Callable[..., list[list[int]]], send: Callable[[int, dict, bool], None],
                 cancelled: Callable[[int], bool] = lambda index: False):
        self.tokenizer = tokenizer
        self.jobs = jobs
        self.group_size = group_size
        self.decode_group = decode_group
        self.send = send
        self.cancelled = cancelled
        self.ranges: dict[int, tuple[int, int]] = {}
        start = 0
        for index, job in enumerate(jobs):
            if job is not None:
                self.ranges[index] = (start, start + len(job.features))
                start += len(job.features)
        self.tokens: list[list[int]] = [[] for _ in range(start)]
        self.finished = np.zeros(start, dtype=bool)
        self.sent = {index: "" for index in self.ranges}
        self._cancelled = CancelWatch(cancelled)  # asked of Triton at most every CANCEL_CHECK_S
        self.gone = self._cancelled.gone

    def run(self) -> None:
        live = [(i, self.jobs[i]) for i in self.ranges]
        if not live:
            return
        features = np.concatenate([job.features for _, job in live])
        prompts = np.concatenate([job.prompts for _, job in live]).astype(np.int64)
        bounds = np.array([job.max_new_tokens for _, job in live for _ in job.features], dtype=np.int64)
        for start in range(0, len(features), self.group_size):
            stop = min(start + self.group_size, len(features))
            if all(i in self.gone or self._cancelled(i) for i, (a, b) in self.ranges.items() if a < stop and b > start):
                continue  # every request of this group has gone
            fill_languages(prompts, start, stop)
            tokens = self.decode_group(features[start:stop], prompts[start:stop], bounds[start:stop],
                                       lambda state, offset=start: self._step(offset, state))
            self.tokens[start:stop] = tokens
            self.finished[start:stop] = True
        for index, (a, b) in self.ranges.items():
            if index in self.gone:
                self.send(index, stream_outputs("", "", True), True)
                continue
            texts = [self.tokenizer.decode(t).strip() for t in self.tokens[a:b]]
            transcript = " ".join(t for t in texts if t)
            language = item_languages(self.tokenizer, prompts[a:b], [b - a])[0]
            segments = segments_json(self.tokenizer, self.tokens[a:b], self.jobs[index].spans, language)
            duration = self.jobs[index].duration
            self.send(index, stream_outputs(transcript, text_delta(self.sent[index], transcript), True, segments,
                                            language, duration), True)

    def _step(self, offset: int, state: "GreedyBatch") -> None:
        count = len(state.tokens)
        self.tokens[offset:offset + count] = state.tokens
        self.finished[offset:offset + count] = state.finished
        for index, (a, b) in self.ranges.items():
            if b <= offset or a >= offset + count:
                continue
            if self._cancelled(index):
                state.stop(range(max(a, offset) - offset, min(b, offset + count) - offset))
                continue
            if not self.jobs[index].partials:
                continue
            prefix = stable_prefix([self.tokenizer.decode(t) for t in self.tokens[a:b]], self.finished[a:b])
            delta = text_delta(self.sent[index], prefix)
            if delta:
                self.sent[index] = prefix
                self.send(index, stream_outputs(prefix, delta, False), False)


def plan_stream_job(tokenizer: WhisperTokenizer, filters: np.ndarray, audio: np.ndarray,
                    language: np.ndarray | None, task: np.ndarray | None, max_new_tokens: np.ndarray | None,
                    timestamps: np.ndarray | None = None, vad_filter: np.ndarray | None = None, *,
                    parameters: Mapping[str, Any], limits: Mapping[str, Any], vad: SileroVad | None = None,
                    vad_default: str = "off", **defaults) -> StreamJob:
    """One ``speech_recognition_stream`` request (one audio item: a stream answers one clip) → its
    job; InputError naming the input otherwise. ``vad_filter`` as ``audio_features`` takes it
    (``features.vad_modes``; ``vad_default`` without it)."""
    if audio.size != 1:
        raise InputError(f"input 'audio' holds {audio.size} items; a streamed transcript takes one clip per request")
    (mode,) = vad_modes(vad_filter, 1, vad_default)
    samples = decode_audio(as_bytes(audio.reshape(-1)[0]), **limits)
    features, spans = audio_windows(samples, filters, **vad_arguments(mode, vad))
    job = plan_request(tokenizer, features[None], None, language, task, max_new_tokens, timestamps, **defaults)
    partials = str(parameters.get("partials", True)).lower() != "false"
    # no window (no speech under VAD): nothing to decode, an empty final transcript
    bound = int(job.max_new_tokens[0]) if len(job.max_new_tokens) else 0
    return StreamJob(features, spans, job.prompts, bound, partials, len(samples) / SAMPLE_RATE)
