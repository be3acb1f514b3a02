"""Whisper's log-mel features: the mel filters, one window's log-mel spectrogram, and encoded
audio → the feature windows of a clip (with their spans in time, for timed transcripts: the
``window_spans`` that ``audio_features`` outputs and ``whisper_decode`` times its segments by)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from triton_pipelines.pipelines.speech.audio import decode_audio
from triton_pipelines.pipelines.speech.config import HOP_LENGTH, N_FFT, N_FRAMES, SAMPLE_RATE, WINDOW_SAMPLES
from triton_pipelines.pipelines.speech.windows import is_silent, sounding_windows, window_cuts


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


def audio_to_features(data: bytes, filters: np.ndarray, index: int = 0, **limits) -> np.ndarray:
    """Encoded audio → ``[windows, n_mels, 3000]`` float32 (silent windows left out)."""
    audio = decode_audio(data, index=index, **limits)
    return np.stack([log_mel_spectrogram(w, filters) for w in sounding_windows(audio)])


def audio_to_timed_features(data: bytes, filters: np.ndarray, index: int = 0,
                            **limits) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """``audio_to_features`` and each kept window's span in the audio, in seconds (start, end): the
    segments of a timed transcript (``speech_recognition_stream``)."""
    audio = decode_audio(data, index=index, **limits)
    cuts = window_cuts(audio) + [len(audio)]
    spans = [(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    kept = [(a, b) for a, b in spans if not is_silent(audio[a:b])] or spans[:1]
    features = np.stack([log_mel_spectrogram(audio[a:b], filters) for a, b in kept])
    return features, [(a / SAMPLE_RATE, b / SAMPLE_RATE) for a, b in kept]


def pad_spans(spans: Sequence[Sequence[tuple[float, float]]], windows: int) -> np.ndarray:
    """Per-item window spans (start, end in seconds: ``audio_to_timed_features``) → ``[items,
    windows, 2]`` float32, padding windows (0, 0): ``audio_features``' ``window_spans``."""
    padded = np.zeros((len(spans), windows, 2), dtype=np.float32)
    for item, item_spans in enumerate(spans):
        if item_spans:
            padded[item, :len(item_spans)] = item_spans
    return padded
