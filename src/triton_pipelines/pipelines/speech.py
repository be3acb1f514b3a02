"""Speech pipeline logic: audio bytes → 16 kHz mono → Whisper log-mel windows, the Whisper
tokenizer (tiktoken, offline), and greedy decoding of the ``whisper_encoder``/``whisper_decoder``
ONNX pair.

Everything here is plain numpy (plus soundfile, soxr, tiktoken, onnxruntime for the in-process
reference); the Triton models ``audio_features`` and ``whisper_decode`` are thin adapters over it.

Greedy decoding (``GreedyDecoder``, token selection in ``GreedyBatch``) is the same loop in Triton
(one BLS call to ``whisper_decoder`` per step) and in process (``WhisperOnnx.decode_windows``): every window starts from
the prompt ``<|startoftranscript|><|lang|><|task|><|notimestamps|>``; each step feeds the new
tokens and the self-attention cache (on the embedded target the decoder keeps that cache between
steps, and the cross K/V: ``GreedyDecoder``'s ``cache_key``), takes the argmax over the text tokens plus
``<|endoftext|>`` with Whisper's standard suppression (every other special token, the non-speech
symbols, and a blank or ``<|endoftext|>`` as the first token: what openai-whisper, faster-whisper
and transformers do by default), and a window leaves the batch at ``<|endoftext|>`` or after
``max_new_tokens``.
"""

from __future__ import annotations

import base64
import io
import json
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from triton_pipelines.limits import MAX_AUDIO_BYTES, MAX_AUDIO_SECONDS
from triton_pipelines.errors import InputError, UpstreamError, as_bytes, decode_utf8
from triton_pipelines.pipelines.onnx_runner import NOT_CACHED, onnx_session

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE  # 480000
N_FRAMES = WINDOW_SAMPLES // HOP_LENGTH  # 3000
# Whisper's text context is 448 positions; 4 go to the prompt.
MAX_TARGET_POSITIONS = 448
PROMPT_LENGTH = 4
# Decoding work is channels × rate × seconds, read from the header before decoding: 300 s of 48 kHz
# stereo. A small FLAC of 8 channels at 192 kHz would otherwise decode to GBs.
MAX_DECODED_SAMPLES = 300 * 48000 * 2
# A request's cost must follow from what it carries, not from what its header declares:
# - the sample rate may not be below telephone band (8 kHz): a 644-byte WAV at 1 Hz declared 300 s
#   and was resampled to 4.8 M samples, 10 Whisper windows (17 s of compute);
# - only the formats we document (libsndfile reads many more: AIFF, CAF, XI, PAF, ... parsers we
#   have no reason to expose): WAV (also WAVEX, RF64), FLAC, OGG (Vorbis, Opus);
# - windows that are digital silence (peak-to-peak under SILENCE_PEAK_TO_PEAK, ~4 LSB of 16-bit
#   audio: nothing to hear) are not decoded: a few KB of FLAC or Vorbis silence declaring 300 s
#   costs one window, not ten. A clip that is silent throughout keeps its first window.
MIN_SAMPLE_RATE = 8000
AUDIO_FORMATS = ("WAV", "WAVEX", "RF64", "FLAC", "OGG")
SILENCE_PEAK_TO_PEAK = 2.0 ** -13
# Decoded and downmixed a block at a time: memory stays at the mono signal's size.
DECODE_BLOCK_FRAMES = 1 << 18

# openai-whisper's LANGUAGES keys, in token order (large-v3 adds "yue": 100 languages).
LANGUAGE_CODES = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur "
    "hr bg lt la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si "
    "km sn yo so af oc ka be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln "
    "ha ba jw su yue"
).split()
TASKS = ("transcribe", "translate")
# What a request that names no language, task or max_new_tokens gets.
DEFAULT_LANGUAGE = "en"
DEFAULT_TASK = "transcribe"
DEFAULT_MAX_NEW_TOKENS = 224

# The parameters the builder writes into the Python models' config.pbtxt (the sources name none of
# them): these constants are the one place each value lives (docs/design.md, "Change a limit").
_AUDIO_LIMITS = {"max_audio_seconds": MAX_AUDIO_SECONDS, "max_audio_bytes": MAX_AUDIO_BYTES,
                 "max_decoded_samples": MAX_DECODED_SAMPLES, "min_sample_rate": MIN_SAMPLE_RATE}
_DECODE_DEFAULTS = {"default_language": DEFAULT_LANGUAGE, "default_task": DEFAULT_TASK,
                    "max_new_tokens": DEFAULT_MAX_NEW_TOKENS}
CONFIG_PARAMETERS = {
    "audio_features": _AUDIO_LIMITS,
    "whisper_decode": _DECODE_DEFAULTS,
    "speech_recognition_stream": {**_DECODE_DEFAULTS, **_AUDIO_LIMITS},  # both steps in one model
}


# ---------------------------------------------------------------------------------------------
# Audio


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


# Audio longer than one window is cut in a pause, not at exactly 30 s: within the last
# SEAM_SEARCH_SECONDS of each window, at the centre of the quietest SEAM_QUIET_SECONDS, so that no
# word is split between two windows (one would drop it or both would transcribe half of it).
SEAM_SEARCH_SECONDS = 5.0
SEAM_QUIET_SECONDS = 0.2


def window_cuts(audio: np.ndarray) -> list[int]:
    """Sample offsets where each window starts: 0, then one cut per window of a longer clip, each
    window at most 30 s and at least 30 s − ``SEAM_SEARCH_SECONDS``, cut in the quietest stretch."""
    quiet = int(SEAM_QUIET_SECONDS * SAMPLE_RATE)
    search = int(SEAM_SEARCH_SECONDS * SAMPLE_RATE)
    cuts, start = [0], 0
    while len(audio) - start > WINDOW_SAMPLES:
        low = start + WINDOW_SAMPLES - search
        high = min(start + WINDOW_SAMPLES, len(audio) - (quiet - quiet // 2))
        region = audio[low - quiet // 2:high + quiet - quiet // 2].astype(np.float64)
        running = np.concatenate([[0.0], np.cumsum(region * region)])
        power = (running[quiet:] - running[:-quiet]) / quiet  # mean power of the stretch centred on low..high
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


def is_silent(window: np.ndarray) -> bool:
    """Digital silence: peak-to-peak amplitude under ``SILENCE_PEAK_TO_PEAK`` (a constant offset too)."""
    return len(window) == 0 or float(window.max()) - float(window.min()) < SILENCE_PEAK_TO_PEAK


def sounding_windows(audio: np.ndarray) -> list[np.ndarray]:
    """``split_windows`` without the windows that are digital silence (nothing to transcribe, and
    cheap to send compressed); the first window when all of them are."""
    windows = split_windows(audio)
    return [w for w in windows if not is_silent(w)] or windows[:1]


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


def pad_windows(features: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-item ``[windows_i, n_mels, 3000]`` → ``[items, max windows, n_mels, 3000]`` (zero
    windows after each item's own) and ``windows_i`` as int32 ``[items]``."""
    if not features:
        raise InputError("input 'audio' is an empty batch: send at least one audio file")
    counts = np.array([len(f) for f in features], dtype=np.int32)
    stacked = np.zeros((len(features), int(counts.max()), *features[0].shape[1:]), dtype=np.float32)
    for item, windows in enumerate(features):
        stacked[item, :len(windows)] = windows
    return stacked, counts


# ---------------------------------------------------------------------------------------------
# Tokenizer


class WhisperTokenizer:
    """The multilingual Whisper vocabulary, built exactly as ``whisper/tokenizer.py`` builds it,
    from ``multilingual.tiktoken`` on disk (no download)."""

    def __init__(self, vocab_file: Path | str, num_languages: int = 99):
        import tiktoken

        ranks = {}
        with open(vocab_file) as handle:
            for line in handle:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        self.languages = LANGUAGE_CODES[:num_languages]
        specials = ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{code}|>" for code in self.languages],
                    "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                    "<|notimestamps|>", *[f"<|{i * 0.02:.2f}|>" for i in range(1501)]]
        n_vocab = len(ranks)
        special_tokens = {}
        for token in specials:
            special_tokens[token] = n_vocab
            n_vocab += 1
        self.encoding = tiktoken.Encoding(
            name=Path(vocab_file).name, explicit_n_vocab=n_vocab,
            pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
            mergeable_ranks=ranks, special_tokens=special_tokens)
        self.special = special_tokens
        self.n_vocab = n_vocab
        self.eot = special_tokens["<|endoftext|>"]
        self.sot = special_tokens["<|startoftranscript|>"]
        self.no_timestamps = special_tokens["<|notimestamps|>"]

    @classmethod
    def for_vocab_size(cls, vocab_file: Path | str, vocab_size: int) -> "WhisperTokenizer":
        """51865 (tiny ... large-v2: 99 languages) or 51866 (large-v3: 100)."""
        return cls(vocab_file, num_languages=vocab_size - 51865 + 99)

    def prompt(self, language: str = DEFAULT_LANGUAGE, task: str = DEFAULT_TASK) -> list[int]:
        """``<|startoftranscript|><|language|><|task|><|notimestamps|>``; InputError for an unknown
        language code or task."""
        if language not in self.languages:
            raise InputError(f"unknown language {language!r}: use a Whisper language code such as 'en', 'de', 'fr'")
        if task not in TASKS:
            raise InputError(f"unknown task {task!r}: use 'transcribe' or 'translate'")
        return [self.sot, self.special[f"<|{language}|>"], self.special[f"<|{task}|>"], self.no_timestamps]

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text)

    @cached_property
    def non_speech_tokens(self) -> tuple[int, ...]:
        """Tokens of symbols that are not speech (music notes, brackets, ...), as openai-whisper's
        ``Tokenizer.non_speech_tokens`` (and faster-whisper's ``suppress_tokens=[-1]``) computes
        them: Whisper never transcribes them by default. Hyphens and quotes stay allowed between
        words, but not at the start of one."""
        symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
        miscellaneous = set("♩♪♫♬♭♮♯")
        result = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in symbols + sorted(miscellaneous):
            for tokens in (self.encode(symbol), self.encode(" " + symbol)):
                if len(tokens) == 1 or symbol in miscellaneous:
                    result.add(tokens[0])
        return tuple(sorted(result))

    def suppress_masks(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The additive logit masks of greedy decoding: every step, and the first generated token
        (which may also not be a blank or ``<|endoftext|>``: Whisper's ``suppress_blank``)."""
        mask = suppress_mask(vocab_size, self.eot, self.non_speech_tokens)
        begin = mask.copy()
        begin[[self.encode(" ")[0], self.eot]] = -np.inf
        return mask, begin

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the text tokens (special tokens dropped)."""
        return self.encoding.decode([int(i) for i in ids if int(i) < self.eot])


# ---------------------------------------------------------------------------------------------
# Greedy decoding


def suppress_mask(vocab_size: int, eot: int, tokens: Sequence[int] = ()) -> np.ndarray:
    """Additive mask over the logits: every special token except ``<|endoftext|>`` is suppressed
    (the prompt already fixed language/task, and timestamps are off), and ``tokens``."""
    mask = np.zeros(vocab_size, dtype=np.float32)
    mask[eot + 1:] = -np.inf
    mask[list(tokens)] = -np.inf
    return mask


@dataclass
class GreedyBatch:
    """Greedy token selection for a batch of windows that share one prompt length; the caller
    owns the tensors (self-attention cache, cross K/V) and runs the decoder.

    Each step: ``logits [rows, vocab]`` for the rows in ``active`` → ``advance`` appends each row's
    argmax (special tokens other than ``<|endoftext|>`` suppressed) and returns the rows to keep
    when some window finished (``<|endoftext|>`` or ``max_new_tokens``), else ``None``: the caller
    then gathers those rows of its cache and cross K/V. With ``compact=False`` finished windows
    stay in the batch (their tokens are ignored) and ``advance`` always returns ``None``: for a
    device where gathering rows costs more than carrying them. ``begin_mask`` replaces ``mask``
    for the first generated token (``WhisperTokenizer.suppress_masks``).
    """

    prompts: np.ndarray  # [N, prompt_length] int64
    eot: int
    max_new_tokens: int | np.ndarray  # one bound, or one per window
    mask: np.ndarray  # [vocab] additive
    compact: bool = True
    begin_mask: np.ndarray | None = None
    tokens: list[list[int]] = field(init=False)
    active: np.ndarray = field(init=False)  # window index of each row
    next_ids: np.ndarray = field(init=False)  # [rows, T] int64: the decoder's next input_ids
    steps: int = field(init=False, default=0)

    def __post_init__(self):
        count = len(self.prompts)
        self.tokens = [[] for _ in range(count)]
        self.active = np.arange(count)
        self._finished = np.zeros(count, dtype=bool)
        self.next_ids = np.ascontiguousarray(self.prompts, dtype=np.int64)
        self._bounds = np.broadcast_to(np.asarray(self.max_new_tokens, dtype=np.int64), (count,))
        self._finished[self._bounds <= 0] = True

    @property
    def done(self) -> bool:
        return bool(self._finished.all())

    @property
    def finished(self) -> np.ndarray:
        """Per window: finished (``<|endoftext|>`` or its bound)."""
        return self._finished

    def stop(self, windows) -> None:
        """Finish these windows now (their client has gone): they leave the batch at the next step."""
        self._finished[list(windows)] = True

    def history(self) -> np.ndarray:
        """Every row's input so far, ``[rows, prompt + steps]``: its prompt and the tokens it
        generated (the last one is its ``next_ids``), for a decoder that lost the row's
        self-attention cache and computes it again from the start. A running row has generated one
        token per step; a finished row still in the batch (``compact=False``, or stopped since the
        last step) is padded with ``<|endoftext|>`` (its logits are ignored)."""
        ids = []
        for window in self.active:
            generated = self.tokens[window]
            if len(generated) != self.steps and not self._finished[window]:
                raise RuntimeError(f"window {window} has {len(generated)} tokens after {self.steps} steps")
            ids.append([*self.prompts[window], *generated, *[self.eot] * (self.steps - len(generated))])
        return np.array(ids, dtype=np.int64)

    def advance(self, logits: np.ndarray) -> np.ndarray | None:
        mask = self.begin_mask if self.steps == 0 and self.begin_mask is not None else self.mask
        chosen = np.argmax(logits + mask, axis=-1).astype(np.int64)
        keep = []
        for row, (window, token) in enumerate(zip(self.active, chosen)):
            if self._finished[window]:
                continue
            token = int(token)
            if token == self.eot:
                self._finished[window] = True
                continue
            self.tokens[window].append(token)
            if len(self.tokens[window]) >= self._bounds[window]:
                self._finished[window] = True
            else:
                keep.append(row)
        self.steps += 1
        if not self.compact or len(keep) == len(self.active):
            self.next_ids = chosen.reshape(-1, 1)
            return None
        rows = np.asarray(keep, dtype=np.int64)
        self.active = self.active[rows]
        self.next_ids = chosen[rows].reshape(-1, 1)
        return rows


def cross_names(layers: int) -> list[str]:
    return [name for i in range(layers) for name in (f"cross_key_{i}", f"cross_value_{i}")]


# One decoder step: (input_ids [rows, T], past_self_kv, cross K/V by name, request parameters) →
# (logits [rows, vocab], present_self_kv) as numpy. The cross K/V are the caller's tensors
# (numpy in process, Triton tensors in whisper_decode): the loop only hands them on. With an
# ``input_cache_key`` in the parameters the decoder keeps the self-attention K/V: past_self_kv is
# None where the step sends none (the decoder's own), and the step asks only for the logits
# (present_self_kv: None).
DecoderStep = Callable[[np.ndarray, np.ndarray | None, Mapping[str, Any], Mapping[str, str]],
                       tuple[np.ndarray, np.ndarray | None]]
# The given rows of cross K/V tensors, as tensors of the same kind.
GatherRows = Callable[[Mapping[str, Any], np.ndarray], Mapping[str, Any]]


def gather_arrays(arrays: Mapping[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(value[rows]) for name, value in arrays.items()}


class GreedyDecoder:
    """The greedy decoding loop over a KV-cached decoder step, shared by the Triton model
    ``whisper_decode`` (each step a BLS call to ``whisper_decoder``) and the in-process reference
    ``WhisperOnnx`` (each step an ONNX Runtime run): token selection is ``GreedyBatch``.

    ``cache_key``: the decoder keeps the cross K/V and the self-attention K/V of the current group
    under this key (the embedded target: ``onnx_runner.InputCache``, its state pair
    ``past_self_kv=present_self_kv``). The first step sends the cross K/V and a zero-length
    ``past_self_kv`` with the key; later steps send only ``input_ids``, the key and the windows
    still running (request parameters ``input_cache_key`` and ``input_cache_rows``), and ask only
    for the logits. A step that reaches a decoder instance without them (another instance, an
    evicted slot, a restart: ``onnx_runner.NOT_CACHED`` in an ``UpstreamError``) starts the
    running windows again: their cross K/V, a zero-length past and as ``input_ids`` each window's
    prompt and the tokens it generated so far (``GreedyBatch.history``; the decoder returns the
    logits of the last position whatever the input length). Without a key (the gpu target) every
    step sends the cross K/V of the running windows and the self-attention K/V, and gets the
    new self-attention K/V back."""

    def __init__(self, tokenizer: WhisperTokenizer, vocab_size: int, step: DecoderStep,
                 gather: GatherRows = gather_arrays, cache_key: str | None = None):
        self.eot = tokenizer.eot
        self.mask, self.begin_mask = tokenizer.suppress_masks(vocab_size)
        self.step = step
        self.gather = gather
        self.cache_key = cache_key

    def decode(self, prompts: np.ndarray, max_new_tokens: int | np.ndarray, cross: Mapping[str, Any],
               heads: int, head_dim: int, compact: bool = True,
               on_step: Callable[["GreedyBatch"], None] | None = None) -> list[list[int]]:
        """``prompts [N, 4]`` and the encoder's cross K/V of those N windows → generated ids per
        window. ``compact=False``: finished windows stay in the batch (``GreedyBatch``), for cross
        K/V whose rows cannot be gathered here (on a GPU). ``on_step(state)``: after every step
        (``state.tokens`` so far, ``state.finished``), e.g. to stream partial transcripts."""
        state = GreedyBatch(prompts, self.eot, max_new_tokens, self.mask, compact=compact, begin_mask=self.begin_mask)

        def empty_past(rows: int) -> np.ndarray:  # [rows, 2 * layers, heads, 0, head_dim]
            return np.zeros((rows, len(cross), heads, 0, head_dim), np.float32)

        past: np.ndarray | None = empty_past(len(prompts))  # first step: zero-length self-attention cache
        sent = cross  # first step: the tensors themselves (a caching decoder stores them)
        while not state.done:
            if self.cache_key is None:
                logits, present = self.step(state.next_ids, past, sent, {})
            else:
                parameters = {"input_cache_key": self.cache_key,
                              "input_cache_rows": ",".join(str(w) for w in state.active)}
                try:
                    logits, _ = self.step(state.next_ids, past, sent, parameters)
                except UpstreamError as error:
                    if NOT_CACHED not in str(error):
                        raise
                    logits, _ = self.step(state.history(), empty_past(len(state.active)),
                                          self.gather(cross, state.active), parameters)
            rows = state.advance(logits)
            if on_step is not None:
                on_step(state)
            if self.cache_key is not None:  # the decoder keeps both K/V: later steps send neither
                past, sent = None, {}
                continue
            past = present if rows is None else present[rows]
            if rows is not None:
                sent = self.gather(sent, rows)
        return state.tokens


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    heads: int
    head_dim: int
    vocab_size: int
    n_mels: int

    @classmethod
    def from_sessions(cls, encoder, decoder) -> "DecoderShape":
        """Read the architecture from the ONNX graphs' static dims."""
        inputs = {i.name: i.shape for i in decoder.get_inputs()}
        layers = sum(1 for name in inputs if name.startswith("cross_key_"))
        _, heads, head_dim, _ = inputs["cross_key_0"]
        vocab = decoder.get_outputs()[0].shape[1]
        n_mels = encoder.get_inputs()[0].shape[1]
        return cls(layers, int(heads), int(head_dim), int(vocab), int(n_mels))


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


def plan_request(tokenizer: WhisperTokenizer, features: np.ndarray, num_windows: np.ndarray | None,
                 language: np.ndarray | None = None, task: np.ndarray | None = None,
                 max_new_tokens: np.ndarray | None = None, default_language: str = DEFAULT_LANGUAGE,
                 default_task: str = DEFAULT_TASK,
                 default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> DecodeJob:
    """Validate one request's tensors (``features [items, windows, n_mels, 3000]``) → DecodeJob.
    ``max_new_tokens`` may lower the configured bound, never raise it past Whisper's 444."""
    items, padded = features.shape[0], features.shape[1]
    counts = [padded] * items if num_windows is None else [int(c) for c in num_windows.reshape(-1)]
    if len(counts) != items or any(c < 1 or c > padded for c in counts):
        raise InputError(f"input 'num_windows' must hold one count in 1..{padded} per item, got {counts}")
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
    return DecodeJob(windows, np.array(per_window(prompts), dtype=np.int64),
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


def decode_jobs(jobs: Sequence[DecodeJob], group_size: int,
                decode_group: Callable[[np.ndarray, np.ndarray, np.ndarray], list[list[int]]]
                ) -> list[list[list[list[int]]]]:
    """Every window of every job, decoded ``group_size`` windows at a time by
    ``decode_group(features, prompts, max_new_tokens)`` → per job, per item, per window: the ids."""
    # One request per batch (the common case at low load) needs no copy of its windows.
    join = lambda arrays: arrays[0] if len(arrays) == 1 else np.concatenate(arrays)  # noqa: E731
    features = join([job.features for job in jobs])
    prompts = join([job.prompts for job in jobs])
    bounds = join([job.max_new_tokens for job in jobs])
    window_tokens = []
    for start in range(0, len(features), group_size):
        stop = start + group_size
        window_tokens += decode_group(features[start:stop], prompts[start:stop], bounds[start:stop])
    result, offset = [], 0
    for job in jobs:
        count = sum(job.windows_per_item)
        result.append(group_windows(window_tokens[offset:offset + count], job.windows_per_item))
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


class WhisperOnnx:
    """In-process reference: the same two ONNX graphs in ONNX Runtime, same greedy state machine.
    Used by the tests (token equality with Triton) and by the benchmark's baseline."""

    def __init__(self, encoder_onnx: Path | str, decoder_onnx: Path | str, intra_op_threads: int = 0):
        self.encoder = onnx_session(encoder_onnx, intra_op_threads)
        self.decoder = onnx_session(decoder_onnx, intra_op_threads)
        self.shape = DecoderShape.from_sessions(self.encoder, self.decoder)
        self.cross_names = cross_names(self.shape.layers)

    def encode(self, features: np.ndarray) -> dict[str, np.ndarray]:
        outputs = self.encoder.run(self.cross_names, {"input_features": features.astype(np.float32)})
        return dict(zip(self.cross_names, outputs))

    def decode_windows(self, features: np.ndarray, prompts: np.ndarray, tokenizer: WhisperTokenizer,
                       max_new_tokens: int | np.ndarray) -> list[list[int]]:
        """``features [N, n_mels, 3000]`` and ``prompts [N, 4]`` → generated ids per window."""
        return self.decode_encoded(self.encode(features), prompts, tokenizer, max_new_tokens)

    def decode_encoded(self, cross: dict[str, np.ndarray], prompts: np.ndarray, tokenizer: WhisperTokenizer,
                       max_new_tokens: int | np.ndarray) -> list[list[int]]:
        """Greedy decoding from the encoder's cross K/V (``encode``)."""
        decoder = GreedyDecoder(tokenizer, self.shape.vocab_size, self.step)
        return decoder.decode(prompts, max_new_tokens, cross, self.shape.heads, self.shape.head_dim)

    def step(self, input_ids: np.ndarray, past: np.ndarray, cross: Mapping[str, np.ndarray],
             parameters: Mapping[str, str]) -> tuple[np.ndarray, np.ndarray]:
        logits, present = self.decoder.run(["logits", "present_self_kv"],
                                           {"input_ids": input_ids, "past_self_kv": past, **cross})
        return logits, present


# ---------------------------------------------------------------------------------------------
# Streaming partial transcripts (speech_recognition_stream)


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


# How often a streamed request's cancellation is asked for while it decodes (a decoder step of
# Whisper base takes ~20-60 ms on a CPU, a few ms on a GPU).
CANCEL_CHECK_S = 0.1


@dataclass
class StreamJob:
    """One ``speech_recognition_stream`` request: its windows, their spans in the audio, prompts and
    token bound, and whether it wants partial transcripts."""

    features: np.ndarray  # [windows, n_mels, 3000]
    spans: list[tuple[float, float]]
    prompt: list[int]
    max_new_tokens: int
    partials: bool = True


def stream_outputs(transcript: str, delta: str, final: bool, segments: str = "[]") -> dict[str, np.ndarray]:
    """One response of ``speech_recognition_stream`` (a batch of one item)."""
    return {"transcript": np.array([[transcript.encode()]], dtype=np.object_),
            "delta": np.array([[delta.encode()]], dtype=np.object_),
            "is_final": np.array([[final]], dtype=bool),
            "segments": np.array([[segments.encode()]], dtype=np.object_)}


class StreamDecode:
    """The windows of every request of one ``execute`` decoded together (as ``whisper_decode``
    does: one encoder pass per group, one decoder step per group for every running window), with a
    partial transcript sent to a request whenever its stable prefix (``stable_prefix``) grows, and
    one final response with the transcript and its segments (one per window, with its times).

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
        self.gone: set[int] = set()
        self.checked: dict[int, float] = {}

    def run(self) -> None:
        live = [(i, self.jobs[i]) for i in self.ranges]
        if not live:
            return
        features = np.concatenate([job.features for _, job in live])
        prompts = np.array([job.prompt for _, job in live for _ in job.features], dtype=np.int64)
        bounds = np.array([job.max_new_tokens for _, job in live for _ in job.features], dtype=np.int64)
        for start in range(0, len(features), self.group_size):
            stop = min(start + self.group_size, len(features))
            if all(i in self.gone or self._cancelled(i) for i, (a, b) in self.ranges.items() if a < stop and b > start):
                continue  # every request of this group has gone
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
            segments = json.dumps([{"start": round(s, 3), "end": round(e, 3), "text": text, "tokens": tokens}
                                   for (s, e), text, tokens in zip(self.jobs[index].spans, texts, self.tokens[a:b])])
            self.send(index, stream_outputs(transcript, text_delta(self.sent[index], transcript), True, segments), True)

    def _cancelled(self, index: int) -> bool:
        """Asked of Triton at most every ``CANCEL_CHECK_S`` per request (each question is a round trip
        from the stub to the server)."""
        now = time.monotonic()
        if index not in self.gone and now - self.checked.get(index, -1e9) >= CANCEL_CHECK_S:
            self.checked[index] = now
            if self.cancelled(index):
                self.gone.add(index)
        return index in self.gone

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
                    parameters: Mapping[str, Any], limits: Mapping[str, Any], **defaults) -> StreamJob:
    """One ``speech_recognition_stream`` request (one audio item: a stream answers one clip) → its
    job; InputError naming the input otherwise."""
    if audio.size != 1:
        raise InputError(f"input 'audio' holds {audio.size} items; a streamed transcript takes one clip per request")
    features, spans = audio_to_timed_features(as_bytes(audio.reshape(-1)[0]), filters, **limits)
    job = plan_request(tokenizer, features[None], None, language, task, max_new_tokens, **defaults)
    partials = str(parameters.get("partials", True)).lower() != "false"
    return StreamJob(features, spans, job.prompts[0].tolist(), int(job.max_new_tokens[0]), partials)
