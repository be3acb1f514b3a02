"""Voice activity detection: Silero VAD v6 (the ONNX file of the faster-whisper wheel, MIT) run
with ONNX Runtime, which audio is speech (``speech_spans``: faster-whisper's
``get_speech_timestamps``), and speech packed into Whisper windows at speech boundaries
(``pack_windows``), each with the map from its own time to the clip's (``TimeMap``, as
faster-whisper's ``SpeechTimestampsMap``).

A window made of speech spans holds the spans' samples back to back: the silence between two
spans (at least ``min_silence_ms`` − 2 × ``speech_pad_ms``, 1.2 s by default) is left out, so a
long file needs fewer windows (``BatchedInferencePipeline`` packs them the same way). A clip with
no speech gives no window: nothing is decoded, the transcript is empty.

Bounded on any audio: spans never overlap and each lasts at most ``max_speech_s`` (less than a
window), and the windows are packed greedily, so two consecutive windows together hold more
than 30 s of speech: a clip of N seconds gives at most 2 · ceil(N / 30) windows, whatever its
speech and silence do (alternating every 10 ms included: tested).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from triton_pipelines.pipelines.speech.config import SAMPLE_RATE, WINDOW_SAMPLES

# The file name in faster-whisper's assets and in the audio_features model folder (the builder copies it).
VAD_MODEL_FILE = "silero_vad_v6.onnx"
FRAME_SAMPLES = 512  # Silero's frame at 16 kHz: 32 ms
CONTEXT_SAMPLES = 64  # the end of the previous frame, prepended to each frame
STATE_SHAPE = (1, 1, 128)
# Frames per ONNX Runtime call (faster-whisper's encoder_batch_size): 10000 frames = 320 s, one
# call for any clip within the 300 s limit.
FRAMES_PER_CALL = 10000


@dataclass(frozen=True)
class VadOptions:
    """faster-whisper's ``VadOptions`` defaults, except ``max_speech_s``: a span must fit a
    window (faster-whisper's batched pipeline sets it to the window's 30 s too)."""

    threshold: float = 0.5  # a frame whose speech probability reaches it is speech
    neg_threshold: float | None = None  # below it, silence (default: threshold − 0.15)
    min_speech_ms: int = 0  # shorter spans are dropped
    max_speech_s: float = 30.0  # longer speech is split at its last pause over 98 ms, else cut
    min_silence_ms: int = 2000  # a pause shorter than this stays inside a span
    speech_pad_ms: int = 400  # each span is widened by this much on both sides

    def frames(self, milliseconds: float) -> float:
        return SAMPLE_RATE * milliseconds / 1000


class SileroVad:
    """Silero VAD v6: 16 kHz audio → one speech probability per 512-sample frame."""

    def __init__(self, path: Path | str, threads: int = 1):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.enable_cpu_mem_arena = False
        options.log_severity_level = 4
        self.session = onnxruntime.InferenceSession(str(path), sess_options=options,
                                                    providers=["CPUExecutionProvider"])

    def probabilities(self, audio: np.ndarray) -> np.ndarray:
        """``[frames]`` float32 speech probabilities; the last frame zero-padded."""
        frames = -(-len(audio) // FRAME_SAMPLES)
        padded = np.zeros(max(frames, 1) * FRAME_SAMPLES, dtype=np.float32)
        padded[:len(audio)] = audio
        batched = padded.reshape(-1, FRAME_SAMPLES)
        context = np.zeros((len(batched), CONTEXT_SAMPLES), dtype=np.float32)
        context[1:] = batched[:-1, -CONTEXT_SAMPLES:]
        batched = np.concatenate([context, batched], axis=1)
        h = np.zeros(STATE_SHAPE, dtype=np.float32)
        c = np.zeros(STATE_SHAPE, dtype=np.float32)
        outputs = []
        for start in range(0, len(batched), FRAMES_PER_CALL):
            probs, h, c = self.session.run(None, {"input": batched[start:start + FRAMES_PER_CALL], "h": h, "c": c})
            outputs.append(np.asarray(probs, dtype=np.float32).reshape(-1))
        return np.concatenate(outputs)[:frames]


def raw_segments(probs: np.ndarray, audio_samples: int, options: VadOptions) -> list[list[int]]:
    """Speech probabilities → ``[start, end]`` sample spans before padding: faster-whisper's
    ``get_speech_timestamps`` state machine (hysteresis between the two thresholds, pauses under
    ``min_silence_ms`` kept inside, spans over ``max_speech_s`` split)."""
    window = FRAME_SAMPLES
    threshold = options.threshold
    neg_threshold = max(threshold - 0.15, 0.01) if options.neg_threshold is None else options.neg_threshold
    pad = options.frames(options.speech_pad_ms)
    max_speech = SAMPLE_RATE * options.max_speech_s - window - 2 * pad
    min_silence = options.frames(options.min_silence_ms)
    min_silence_at_max = options.frames(98)
    min_speech = options.frames(options.min_speech_ms)
    triggered, speeches, current = False, [], []
    temp_end = prev_end = next_start = 0
    for i, prob in enumerate(probs.tolist()):
        here = window * i
        if prob >= threshold and temp_end:
            temp_end = 0
            if next_start < prev_end:
                next_start = here
        if prob >= threshold and not triggered:
            triggered, current = True, [here, 0]
            continue
        if triggered and here - current[0] > max_speech:
            if prev_end:
                speeches.append([current[0], prev_end])
                if next_start < prev_end:  # in a pause: wait for speech again
                    triggered, current = False, []
                else:
                    current = [next_start, 0]
                prev_end = next_start = temp_end = 0
            else:  # no pause to cut in: cut here
                speeches.append([current[0], here])
                triggered, current = False, []
                prev_end = next_start = temp_end = 0
                continue
        if prob < neg_threshold and triggered:
            temp_end = temp_end or here
            if here - temp_end > min_silence_at_max:
                prev_end = temp_end
            if here - temp_end < min_silence:
                continue
            if temp_end - current[0] > min_speech:
                speeches.append([current[0], temp_end])
            triggered, current = False, []
            prev_end = next_start = temp_end = 0
    if current and audio_samples - current[0] > min_speech:
        speeches.append([current[0], audio_samples])
    return speeches


def pad_segments(speeches: list[list[int]], audio_samples: int, options: VadOptions) -> list[tuple[int, int]]:
    """Each span widened by ``speech_pad_ms`` (half the gap where two are closer), within the clip."""
    pad = options.frames(options.speech_pad_ms)
    for i, speech in enumerate(speeches):
        if i == 0:
            speech[0] = int(max(0, speech[0] - pad))
        if i == len(speeches) - 1:
            speech[1] = int(min(audio_samples, speech[1] + pad))
            continue
        gap = speeches[i + 1][0] - speech[1]
        if gap < 2 * pad:
            speech[1] += int(gap // 2)
            speeches[i + 1][0] = int(max(0, speeches[i + 1][0] - gap // 2))
        else:
            speech[1] = int(min(audio_samples, speech[1] + pad))
            speeches[i + 1][0] = int(max(0, speeches[i + 1][0] - pad))
    return [(int(a), int(b)) for a, b in speeches if b > a]


def speech_spans(probs: np.ndarray, audio_samples: int, options: VadOptions = VadOptions()) -> list[tuple[int, int]]:
    """Speech probabilities (``SileroVad.probabilities``) → the clip's speech as sample spans
    ``(start, end)``, in order, not overlapping, each at most ``max_speech_s`` long."""
    return pad_segments(raw_segments(probs, audio_samples, options), audio_samples, options)


class TimeMap:
    """A window's own time (seconds into its samples, which are its spans back to back) → the
    clip's time: faster-whisper's ``SpeechTimestampsMap`` for one window. A time at a join
    between two spans is the end of the earlier one with ``is_end`` (a word or segment end),
    else the start of the later one."""

    def __init__(self, spans: Sequence[tuple[int, int]], sample_rate: int = SAMPLE_RATE):
        self.spans = [(int(a), int(b)) for a, b in spans]
        self.sample_rate = sample_rate
        ends, total = [], 0
        for a, b in self.spans:
            total += b - a
            ends.append(total)
        self.local_ends = ends  # each span's end, in window samples

    @property
    def start(self) -> float:
        """Where the window starts in the clip, in seconds."""
        return self.spans[0][0] / self.sample_rate if self.spans else 0.0

    @property
    def end(self) -> float:
        return self.spans[-1][1] / self.sample_rate if self.spans else 0.0

    @property
    def samples(self) -> int:
        """The window's own length in samples (its spans back to back)."""
        return self.local_ends[-1] if self.local_ends else 0

    @property
    def duration(self) -> float:
        return self.samples / self.sample_rate

    @classmethod
    def from_seconds(cls, spans: Sequence[tuple[float, float]], sample_rate: int = SAMPLE_RATE) -> "TimeMap":
        return cls([(int(round(a * sample_rate)), int(round(b * sample_rate))) for a, b in spans], sample_rate)

    def original_time(self, seconds: float, is_end: bool = False) -> float:
        """``seconds`` into the window → seconds into the clip."""
        if not self.spans:
            return seconds
        sample = seconds * self.sample_rate
        index = (bisect.bisect_left if is_end else bisect.bisect_right)(self.local_ends, sample)
        index = min(index, len(self.spans) - 1)
        before = self.local_ends[index - 1] if index else 0
        return (self.spans[index][0] + sample - before) / self.sample_rate


def pack_windows(spans: Sequence[tuple[int, int]], window_samples: int = WINDOW_SAMPLES) -> list[list[tuple[int, int]]]:
    """Speech spans (each at most ``window_samples``) → windows of consecutive spans whose
    samples together fit one window, packed greedily in order (collect_chunks of faster-whisper).
    A span that is longer (not produced by ``speech_spans``) is cut into window-sized pieces."""
    windows: list[list[tuple[int, int]]] = []
    current, length = [], 0
    for a, b in spans:
        for start in range(a, b, window_samples):
            piece = (start, min(b, start + window_samples))
            size = piece[1] - piece[0]
            if current and length + size > window_samples:
                windows.append(current)
                current, length = [], 0
            current.append(piece)
            length += size
    if current:
        windows.append(current)
    return windows


def window_audio(audio: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """A packed window's samples: its spans back to back."""
    if len(spans) == 1:
        return audio[spans[0][0]:spans[0][1]]
    return np.concatenate([audio[a:b] for a, b in spans]) if spans else audio[:0]


def as_time_map(window: "TimeMap | tuple[float, float]") -> TimeMap:
    """A window's time map; a (start, end) pair in seconds is a window of one stretch."""
    return window if isinstance(window, TimeMap) else TimeMap.from_seconds([window])
