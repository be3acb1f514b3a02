"""Encoded audio bytes → 16 kHz mono float32 samples, within the limits (``config``)."""

from __future__ import annotations

import io

import numpy as np

from triton_pipelines.errors import InputError
from triton_pipelines.pipelines.speech.config import (AUDIO_FORMATS, DECODE_BLOCK_FRAMES, MAX_AUDIO_BYTES, MAX_AUDIO_SECONDS, MAX_DECODED_SAMPLES,
                        MIN_SAMPLE_RATE, SAMPLE_RATE)


def decode_audio(data: bytes, index: int = 0, input_name: str = "audio",
                 max_seconds: float = MAX_AUDIO_SECONDS, max_bytes: int = MAX_AUDIO_BYTES,
                 max_decoded_samples: int = MAX_DECODED_SAMPLES,
                 min_sample_rate: int = MIN_SAMPLE_RATE) -> np.ndarray:
    """Encoded WAV/FLAC/OGG bytes → float32 mono samples at 16 kHz.

    Any sample format soundfile reads (8/16/24/32-bit PCM, float), any channel count (averaged),
    any sample rate (resampled with soxr, high quality). Raises InputError naming the element
    and the problem for empty, undecodable, sample-less, non-finite or too long audio.
    """
    import soundfile
    import soxr

    where = f"input '{input_name}'[{index}]"
    if len(data) == 0:
        raise InputError(f"{where} is empty (0 bytes): send an encoded WAV, FLAC or OGG file")
    if len(data) > max_bytes:
        raise InputError(f"{where} is {len(data)} bytes; the limit is {max_bytes} bytes")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as handle:
            rate, frames = handle.samplerate, handle.frames
            if handle.format not in AUDIO_FORMATS:
                raise InputError(f"{where} is {handle.format_info or handle.format} audio; accepted: WAV, FLAC, OGG "
                                 "(Vorbis, Opus)")
            if rate < min_sample_rate:
                raise InputError(f"{where} has a sample rate of {rate} Hz; the minimum is {min_sample_rate} Hz "
                                 "(speech needs at least telephone-band audio)")
            if frames <= 0:
                raise InputError(f"{where} contains no audio samples")
            if frames / rate > max_seconds:
                raise InputError(f"{where} is {frames / rate:.1f} s long; the limit is {max_seconds:g} s")
            channels = handle.channels
            if channels * frames > max_decoded_samples:
                raise InputError(
                    f"{where} decodes to {channels * frames} samples ({channels} channels × {rate} Hz × "
                    f"{frames / rate:.1f} s); the limit is {max_decoded_samples} (300 s of 48 kHz stereo)")
            mono = np.empty(frames, dtype=np.float32)
            filled = 0
            for block in handle.blocks(blocksize=DECODE_BLOCK_FRAMES, dtype="float32", always_2d=True):
                count = min(len(block), frames - filled)
                block = block[:count]
                mono[filled:filled + count] = block.mean(axis=1, dtype=np.float32) if channels > 1 else block[:, 0]
                filled += count
            mono = mono[:filled]
    except InputError:
        raise
    except Exception as error:  # soundfile.LibsndfileError, RuntimeError, EOFError ...
        raise InputError(f"{where} is not a decodable audio file (WAV, FLAC or OGG): {error}") from None
    if mono.shape[0] == 0:
        raise InputError(f"{where} contains no audio samples")
    if not np.isfinite(mono).all():
        raise InputError(f"{where} contains NaN or infinite samples")
    if rate != SAMPLE_RATE:
        mono = soxr.resample(mono, rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    return np.ascontiguousarray(mono, dtype=np.float32)
