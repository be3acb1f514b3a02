"""Window planning: 16 kHz audio cut into Whisper's 30 s windows in pauses, with digitally silent
windows left out, or with voice activity detection (``vad``) only the windows with speech, or only
speech packed into windows at speech boundaries (``config.VAD_MODES``). Every window is a ``TimeMap`` (its spans in the clip, its start
time, its own time → the clip's). And a batch's per-item windows padded into one tensor."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from triton_pipelines.errors import InputError
from triton_pipelines.pipelines.speech.config import SAMPLE_RATE, SILENCE_PEAK_TO_PEAK, WINDOW_SAMPLES
from triton_pipelines.pipelines.speech.vad import SileroVad, TimeMap, VadOptions, pack_windows, speech_spans


# Audio longer than one window is cut in a pause, not at exactly 30 s: within the last
# SEAM_SEARCH_SECONDS of each window, at the centre of the quietest SEAM_QUIET_SECONDS, so that no
# word is split between two windows (one would drop it or both would transcribe half of it).
SEAM_SEARCH_SECONDS = 5.0
SEAM_QUIET_SECONDS = 0.2


def window_cuts(audio: np.ndarray, speech: Sequence[tuple[int, int]] = ()) -> list[int]:
    """Sample offsets where each window starts: 0, then one cut per window of a longer clip, each
    window at most 30 s and at least 30 s − ``SEAM_SEARCH_SECONDS``, cut in the quietest stretch;
    with ``speech`` (VAD's spans, in samples), in the quietest stretch outside them where there is
    one (under noise, the quietest stretch can be a syllable's gap inside speech)."""
    quiet = int(SEAM_QUIET_SECONDS * SAMPLE_RATE)
    search = int(SEAM_SEARCH_SECONDS * SAMPLE_RATE)
    cuts, start = [0], 0
    while len(audio) - start > WINDOW_SAMPLES:
        low = start + WINDOW_SAMPLES - search
        high = min(start + WINDOW_SAMPLES, len(audio) - (quiet - quiet // 2))
        region = audio[low - quiet // 2:high + quiet - quiet // 2].astype(np.float64)
        running = np.concatenate([[0.0], np.cumsum(region * region)])
        power = (running[quiet:] - running[:-quiet]) / quiet  # mean power of the stretch centred on low..high
        inside = np.zeros(len(power), dtype=bool)
        for a, b in speech:
            inside[max(a - low, 0):max(min(b - low, len(power)), 0)] = True
        if inside.any() and not inside.all():
            power = np.where(inside, np.inf, power)
        # The latest of the quietest positions (within 1e-10, -100 dBFS: digital silence ties),
        # so that windows stay long.
        best = int(np.flatnonzero(power <= power.min() + 1e-10)[-1])
        start = low + best
        cuts.append(start)
    return cuts


def split_windows(audio: np.ndarray) -> list[np.ndarray]:
    """Windows of at most 30 s, cut in pauses (``window_cuts``); together exactly the samples of
    ``audio``. At least one window, even for a very short clip."""
    cuts = window_cuts(audio) + [len(audio)]
    return [audio[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def is_silent(window: np.ndarray) -> bool:
    """Digital silence: peak-to-peak amplitude under ``SILENCE_PEAK_TO_PEAK`` (a constant offset too)."""
    return len(window) == 0 or float(window.max()) - float(window.min()) < SILENCE_PEAK_TO_PEAK


def sounding_windows(audio: np.ndarray) -> list[np.ndarray]:
    """``split_windows`` without the windows that are digital silence (nothing to transcribe, and
    cheap to send compressed); the first window when all of them are."""
    windows = split_windows(audio)
    return [w for w in windows if not is_silent(w)] or windows[:1]


def plan_windows(audio: np.ndarray, vad: SileroVad | None = None, options: VadOptions = VadOptions(),
                 pack: bool = True) -> list[TimeMap]:
    """The windows to decode, each a ``TimeMap``. Without ``vad``: ``window_cuts``' windows that are
    not digital silence (the first one when all are), each one span. With it and ``pack``: the
    speech spans (``vad.speech_spans``) packed into windows (``vad.pack_windows``). With it and not
    ``pack``: ``window_cuts``' windows (cut outside speech where they can be) that overlap a speech
    span: a clip of up to 30 s keeps its one window as without VAD. With VAD, none when there is no
    speech."""
    if vad is None:
        cuts = window_cuts(audio) + [len(audio)]
        spans = list(zip(cuts[:-1], cuts[1:]))
        kept = [(a, b) for a, b in spans if not is_silent(audio[a:b])] or spans[:1]
        return [TimeMap([span]) for span in kept]
    speech = speech_spans(vad.probabilities(audio), len(audio), options)
    if pack:
        return [TimeMap(window) for window in pack_windows(speech)]
    cuts = window_cuts(audio, speech) + [len(audio)]
    return [TimeMap([(a, b)]) for a, b in zip(cuts[:-1], cuts[1:])
            if any(start < b and end > a for start, end in speech)]


def pad_windows(features: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-item ``[windows_i, n_mels, 3000]`` → ``[items, max windows, n_mels, 3000]`` (zero
    windows after each item's own) and ``windows_i`` as int32 ``[items]`` (0 for an item without
    speech under VAD)."""
    if not features:
        raise InputError("input 'audio' is an empty batch: send at least one audio file")
    counts = np.array([len(f) for f in features], dtype=np.int32)
    stacked = np.zeros((len(features), int(counts.max()), *features[0].shape[1:]), dtype=np.float32)
    for item, windows in enumerate(features):
        stacked[item, :len(windows)] = windows
    return stacked, counts
