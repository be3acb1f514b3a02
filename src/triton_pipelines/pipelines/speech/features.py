"""Whisper's log-mel features: the mel filters, one window's log-mel spectrogram, and encoded
audio → the feature windows of a clip (with their time maps, for timed transcripts: the
``window_spans`` that ``audio_features`` outputs and ``whisper_decode`` times its segments and
words by). With a ``SileroVad`` (``vad``), only speech is decoded (``windows.plan_windows``; the
modes: ``config.VAD_MODES``)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from triton_pipelines.errors import InputError
from triton_pipelines.pipelines.speech.audio import decode_audio
from triton_pipelines.pipelines.speech.config import (HOP_LENGTH, N_FFT, N_FRAMES, SAMPLE_RATE, VAD_FILTER_MODES,
                                                      VAD_MODES, WINDOW_SAMPLES)
from triton_pipelines.pipelines.speech.vad import SileroVad, TimeMap, window_audio
from triton_pipelines.pipelines.speech.windows import plan_windows


def load_mel_filters(path: Path | str, n_mels: int) -> np.ndarray:
    """``mel_filters.npz`` from openai-whisper's assets (librosa's slaney filters, 80 or 128)."""
    with np.load(path, allow_pickle=False) as filters:
        return filters[f"mel_{n_mels}"].astype(np.float32)


_HANN = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float64)  # periodic


def log_mel_spectrogram(window: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """One window of 16 kHz audio (≤ 30 s) → ``[n_mels, 3000]`` float32, as Whisper computes it:
    zero-pad to 30 s, centered STFT (reflect padding, periodic Hann, n_fft 400, hop 160), drop the
    last frame, power → mel → log10 (floor 1e-10), clamp to max - 8, then (x + 4) / 4."""
    audio = np.zeros(WINDOW_SAMPLES, dtype=np.float64)
    audio[:min(len(window), WINDOW_SAMPLES)] = window[:WINDOW_SAMPLES]
    padded = np.pad(audio, N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH][:N_FRAMES]
    power = np.abs(np.fft.rfft(frames * _HANN, axis=-1)) ** 2  # [3000, 201]
    mel = filters.astype(np.float64) @ power.T
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def windows_features(audio: np.ndarray, windows: list[TimeMap], filters: np.ndarray) -> np.ndarray:
    """The windows' log-mel spectrograms, ``[windows, n_mels, 3000]`` (``[0, n_mels, 3000]`` for none)."""
    if not windows:
        return np.zeros((0, filters.shape[0], N_FRAMES), dtype=np.float32)
    return np.stack([log_mel_spectrogram(window_audio(audio, w.spans), filters) for w in windows])


def audio_windows(audio: np.ndarray, filters: np.ndarray, vad: SileroVad | None = None,
                  pack: bool = True) -> tuple[np.ndarray, list[TimeMap]]:
    """16 kHz audio → its windows' features and their time maps (``windows.plan_windows``)."""
    windows = plan_windows(audio, vad, pack=pack)
    return windows_features(audio, windows, filters), windows


def audio_to_windows(data: bytes, filters: np.ndarray, index: int = 0, vad: SileroVad | None = None,
                     pack: bool = True, **limits) -> tuple[np.ndarray, list[TimeMap]]:
    """Encoded audio → its windows' features and their time maps (``windows.plan_windows``)."""
    return audio_windows(decode_audio(data, index=index, **limits), filters, vad, pack)


def audio_to_features(data: bytes, filters: np.ndarray, index: int = 0, vad: SileroVad | None = None,
                      pack: bool = True, **limits) -> np.ndarray:
    """Encoded audio → ``[windows, n_mels, 3000]`` float32 (silent windows left out; with ``vad``
    only the windows with speech, or only speech packed, no window at all without speech)."""
    return audio_to_windows(data, filters, index, vad, pack, **limits)[0]


def vad_arguments(mode: str, vad: SileroVad | None) -> dict:
    """A ``config.VAD_MODES`` mode → ``audio_to_windows``' ``vad`` and ``pack``."""
    if mode not in VAD_MODES:
        raise ValueError(f"VAD mode {mode!r} is none of {VAD_MODES}")
    return {"vad": None if mode == "off" else vad, "pack": mode == "pack"}


def pad_time_maps(maps: Sequence[Sequence[TimeMap]]) -> np.ndarray:
    """Per-item window time maps → ``[items, rows, 3]`` float32: one row (window, start, end in
    seconds) per stretch of the clip a window holds, padding rows (-1, 0, 0): ``audio_features``'
    ``window_spans`` (``jobs.item_spans`` reads them back)."""
    rows = [[(w, a / m.sample_rate, b / m.sample_rate) for w, m in enumerate(item) for a, b in m.spans] for item in maps]
    padded = np.zeros((len(rows), max((len(r) for r in rows), default=0), 3), dtype=np.float32)
    padded[:, :, 0] = -1
    for item, item_rows in enumerate(rows):
        if item_rows:
            padded[item, :len(item_rows)] = item_rows
    return padded


def vad_modes(raw: np.ndarray | None, count: int, default: str) -> list[str]:
    """The optional ``vad_filter`` BOOL input ``[items, 1]`` → one ``config.VAD_MODES`` mode per
    item (true: pack, false: off; ``default`` where it is absent)."""
    if raw is None:
        return [default] * count
    flat = raw.reshape(-1)
    if flat.size != count:
        raise InputError(f"input 'vad_filter' has {flat.size} elements for {count} audio items")
    return [VAD_FILTER_MODES[bool(value)] for value in flat]


def request_features(items: np.ndarray, modes: list[str], filters: np.ndarray, vad: SileroVad | None,
                     **limits) -> list[tuple[np.ndarray, list[TimeMap]]]:
    """One ``audio_features`` request: each item's windows and their time maps, with VAD as its
    mode says."""
    return [audio_to_windows(bytes(item), filters, index=i, **vad_arguments(mode, vad), **limits)
            for i, (item, mode) in enumerate(zip(items, modes))]
