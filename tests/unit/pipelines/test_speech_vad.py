"""Voice activity detection (triton_pipelines.pipelines.speech.vad) and the windows it plans: the
same speech spans and time maps as faster-whisper's, packing, bounds on hostile audio. No server."""

from __future__ import annotations

import io
import math
import time

import numpy as np
import pytest
import soundfile

from repo_builder.speech_pipeline import vad_model_path, whisper_assets_dir
from triton_pipelines.errors import InputError
from triton_pipelines.pipelines.speech.audio import decode_audio
from triton_pipelines.pipelines.speech.config import SAMPLE_RATE, WINDOW_SAMPLES
from triton_pipelines.pipelines.speech.config import DEFAULT_VAD_MODE, VAD_MODES
from triton_pipelines.pipelines.speech.features import (audio_to_features, audio_to_windows, load_mel_filters,
                                                        request_features, vad_arguments, vad_modes)
from triton_pipelines.pipelines.speech.jobs import decode_jobs, plan_request, transcript_outputs
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer
from triton_pipelines.pipelines.speech.vad import (FRAME_SAMPLES, SileroVad, TimeMap, VadOptions, pack_windows,
                                                   speech_spans, window_audio)
from triton_pipelines.pipelines.speech.windows import pad_windows, plan_windows, split_windows
from tests.support.paths import TEST_DATA

HELLO = decode_audio((TEST_DATA / "speech_hello.wav").read_bytes())  # 3.8 s of espeak-ng speech


@pytest.fixture(scope="module")
def vad() -> SileroVad:
    return SileroVad(vad_model_path())


@pytest.fixture(scope="module")
def filters() -> np.ndarray:
    return load_mel_filters(whisper_assets_dir() / "mel_filters.npz", 80)


def speech_with_pauses(pauses: list[float]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """HELLO, then each pause (s) followed by HELLO again → the audio and where each HELLO is."""
    parts, places, at = [HELLO], [(0, len(HELLO))], len(HELLO)
    for pause in pauses:
        gap = np.zeros(int(pause * SAMPLE_RATE), np.float32)
        parts += [gap, HELLO]
        at += len(gap)
        places.append((at, at + len(HELLO)))
        at += len(HELLO)
    return np.concatenate(parts), places


def faster_whisper_spans(probs: np.ndarray, samples: int, monkeypatch, **options) -> list[tuple[int, int]]:
    """faster-whisper's get_speech_timestamps on the same probabilities (its model swapped out)."""
    from faster_whisper import vad as fw_vad

    monkeypatch.setattr(fw_vad, "get_vad_model", lambda: (lambda audio: probs))
    found = fw_vad.get_speech_timestamps(np.zeros(samples, np.float32), fw_vad.VadOptions(**options))
    return [(s["start"], s["end"]) for s in found]


def test_probabilities_equal_faster_whisper_and_cost_little(vad):
    from faster_whisper.vad import SileroVADModel

    audio, _ = speech_with_pauses([3.0, 1.0])
    started = time.perf_counter()
    probs = vad.probabilities(audio)
    per_audio_second = (time.perf_counter() - started) / (len(audio) / SAMPLE_RATE)
    theirs = SileroVADModel(str(vad_model_path()))(np.pad(audio, (0, FRAME_SAMPLES - len(audio) % FRAME_SAMPLES)))
    assert len(probs) == math.ceil(len(audio) / FRAME_SAMPLES)
    np.testing.assert_allclose(probs, np.asarray(theirs).reshape(-1)[:len(probs)], atol=1e-5)
    assert probs.max() > 0.9 and probs.min() < 0.1
    assert per_audio_second < 0.05  # measured ~2 ms per audio second on one thread


@pytest.mark.parametrize("seed", range(4))
def test_speech_spans_equal_faster_whisper_get_speech_timestamps(seed, monkeypatch):
    """Random probability runs (speech, pauses of every length, flickers) through both state machines."""
    rng = np.random.default_rng(seed)
    runs = rng.integers(1, 200, size=60)
    levels = rng.choice([0.05, 0.4, 0.45, 0.7, 0.95], size=60)
    probs = np.repeat(levels, runs).astype(np.float32)
    samples = len(probs) * FRAME_SAMPLES - int(rng.integers(0, FRAME_SAMPLES))
    for options, theirs in ((VadOptions(), dict(max_speech_duration_s=30)),
                            (VadOptions(min_silence_ms=500, speech_pad_ms=100, min_speech_ms=250),
                             dict(max_speech_duration_s=30, min_silence_duration_ms=500, speech_pad_ms=100,
                                  min_speech_duration_ms=250))):
        assert speech_spans(probs, samples, options) == faster_whisper_spans(probs, samples, monkeypatch, **theirs)


def test_pauses_longer_than_the_minimum_silence_separate_spans(vad):
    audio, places = speech_with_pauses([3.0, 1.0, 4.0])
    spans = speech_spans(vad.probabilities(audio), len(audio))
    # the 1 s pause stays inside a span (under min_silence 2 s), the 3 s and 4 s ones separate
    assert len(spans) == 3
    for (a, b), (start, end) in zip(spans, [places[0], (places[1][0], places[2][1]), places[3]]):
        assert a <= start + 0.1 * SAMPLE_RATE and b >= end - 0.1 * SAMPLE_RATE  # the speech is inside
        assert start - a <= 0.5 * SAMPLE_RATE and b - end <= 0.8 * SAMPLE_RATE  # padded, not much more


def test_noise_and_silence_have_no_speech(vad, filters):
    rng = np.random.default_rng(0)
    for audio in (np.zeros(5 * SAMPLE_RATE, np.float32), (0.05 * rng.standard_normal(10 * SAMPLE_RATE)).astype(np.float32)):
        assert speech_spans(vad.probabilities(audio), len(audio)) == []
        assert plan_windows(audio, vad) == []
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.05 * rng.standard_normal(SAMPLE_RATE)).astype(np.float32), SAMPLE_RATE, format="WAV")
    assert audio_to_features(buffer.getvalue(), filters, vad=vad).shape == (0, 80, 3000)
    assert audio_to_features(buffer.getvalue(), filters).shape == (1, 80, 3000)  # without VAD: decoded


def test_pack_windows_fills_windows_in_order_and_cuts_overlong_spans():
    second = SAMPLE_RATE
    spans = [(0, 10 * second), (12 * second, 25 * second), (27 * second, 35 * second), (40 * second, 75 * second)]
    windows = pack_windows(spans)
    assert windows == [[(0, 10 * second), (12 * second, 25 * second)], [(27 * second, 35 * second)],
                       [(40 * second, 70 * second)], [(70 * second, 75 * second)]]
    for window in windows:
        assert sum(b - a for a, b in window) <= WINDOW_SAMPLES
    assert [s for w in windows for s in w][:3] == spans[:3]
    assert pack_windows([]) == []


def test_time_map_restores_clip_time_like_faster_whisper():
    from faster_whisper.vad import SpeechTimestampsMap

    spans = [(8000, 40000), (72000, 100000), (160000, 164000)]
    ours = TimeMap(spans)
    theirs = SpeechTimestampsMap([{"start": a, "end": b} for a, b in spans], SAMPLE_RATE)
    assert ours.start == 0.5 and ours.end == 164000 / SAMPLE_RATE
    for t in np.linspace(0.0, 4.0, 81):
        assert round(ours.original_time(t), 2) == theirs.get_original_time(t)
        assert round(ours.original_time(t, is_end=True), 2) == theirs.get_original_time(t, is_end=True)
    assert ours.original_time(2.0) == 72000 / SAMPLE_RATE  # the join: the later span's start
    assert ours.original_time(2.0, is_end=True) == 40000 / SAMPLE_RATE  # or, as an end, the earlier's end
    audio = np.arange(200000, dtype=np.float32)
    joined = window_audio(audio, spans)
    assert len(joined) == 64000 and joined[32000] == 72000 and joined[-1] == 163999


def test_long_audio_is_cut_at_speech_boundaries_and_packed(vad):
    audio, places = speech_with_pauses([3.0] * 11)  # 12 × 3.8 s of speech, 3 s apart: 78 s
    windows = plan_windows(audio, vad)
    assert len(split_windows(audio)) == 3 and len(windows) == 2  # the pauses left out: fewer windows
    for window in windows:
        assert sum(b - a for a, b in window.spans) <= WINDOW_SAMPLES
        for a, b in window.spans:  # every span holds whole utterances: no cut inside speech
            assert all(b <= start or a >= end or (a <= start and b >= end) for start, end in places)
    assert sum(len(w.spans) for w in windows) == len(places)
    assert windows[1].start == windows[1].spans[0][0] / SAMPLE_RATE > windows[0].end


@pytest.mark.parametrize("period_ms", [10, 32])
def test_speech_alternating_with_silence_does_not_explode_the_windows(vad, period_ms):
    """300 s where speech and silence alternate every 10 ms (and every Silero frame): at most
    2 · ceil(300 / 30) windows, each at most 30 s of samples."""
    period = int(period_ms * SAMPLE_RATE / 1000)
    speech = np.tile(HELLO, 80)[:300 * SAMPLE_RATE]
    mask = (np.arange(len(speech)) // period) % 2 == 0
    audio = np.where(mask, speech, 0.0).astype(np.float32)
    started = time.perf_counter()
    windows = plan_windows(audio, vad)
    elapsed = time.perf_counter() - started
    assert 1 <= len(windows) <= 2 * math.ceil(300 / 30)
    assert all(sum(b - a for a, b in w.spans) <= WINDOW_SAMPLES for w in windows)
    assert elapsed < 10.0  # ~1 s measured on the shared 2 cores


def test_flickering_probabilities_keep_the_window_bound():
    """The state machine alone, on probabilities flipping every frame or at random, for 300 s."""
    frames = 300 * SAMPLE_RATE // FRAME_SAMPLES
    rng = np.random.default_rng(3)
    for probs in (np.tile([1.0, 0.0], frames // 2), rng.random(frames), np.tile([0.9] * 3 + [0.0] * 70, frames // 73)):
        spans = speech_spans(probs.astype(np.float32), frames * FRAME_SAMPLES)
        windows = pack_windows(spans)
        assert len(windows) <= 2 * math.ceil(300 / 30)
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))


def test_without_vad_the_windows_are_the_pause_cuts(vad):
    audio, _ = speech_with_pauses([30.0])
    plain = plan_windows(audio)
    assert [len(window_audio(audio, w.spans)) for w in plain] == [len(w) for w in split_windows(audio)]
    assert [w.start for w in plain] == [0.0, plain[0].end]


def test_audio_to_windows_gives_features_and_time_maps(vad, filters):
    audio, _ = speech_with_pauses([5.0])
    buffer = io.BytesIO()
    soundfile.write(buffer, audio, SAMPLE_RATE, subtype="FLOAT", format="WAV")
    features, windows = audio_to_windows(buffer.getvalue(), filters, vad=vad)
    assert features.shape == (1, 80, 3000) and len(windows[0].spans) == 2
    assert windows[0].original_time(len(HELLO) / SAMPLE_RATE + 0.5) > 5.0  # past the pause left out


def test_vad_modes_per_item():
    assert vad_modes(None, 3, "windows") == ["windows"] * 3
    assert vad_modes(np.array([[True], [False]]), 2, "windows") == ["pack", "off"]
    with pytest.raises(InputError, match="'vad_filter' has 1 elements for 2 audio items"):
        vad_modes(np.array([[True]]), 2, "windows")
    assert DEFAULT_VAD_MODE in VAD_MODES and set(VAD_MODES) == {"off", "windows", "pack"}
    with pytest.raises(ValueError, match="VAD mode 'on' is none of"):
        vad_arguments("on", None)


def test_the_windows_mode_keeps_the_usual_windows_that_hold_speech(vad, filters):
    """``windows`` (the default): windows of the whole clip cut in pauses, each one stretch of it
    (its times as without VAD), less those where VAD finds no speech; under noise the cuts avoid
    speech (the quietest stretch by energy alone is inside the second utterance here)."""
    rng = np.random.default_rng(5)
    noise = (0.05 * rng.standard_normal(29 * SAMPLE_RATE)).astype(np.float32)
    speech = np.concatenate([HELLO, np.zeros(26 * SAMPLE_RATE - len(HELLO), np.float32)])
    audio = np.concatenate([speech, noise, speech])  # 81 s: speech, silence, noise, speech, silence
    second = (55 * SAMPLE_RATE, 55 * SAMPLE_RATE + len(HELLO))
    plain = plan_windows(audio)
    assert len(plain) == 3 and second[0] < plain[2].start * SAMPLE_RATE < second[1]  # energy cuts into it
    kept = plan_windows(audio, vad, pack=False)
    assert [len(w.spans) for w in kept] == [1, 1] and kept[0].spans == plain[0].spans
    assert kept[1].start * SAMPLE_RATE <= second[0] and kept[1].end * SAMPLE_RATE >= second[1]  # whole
    assert kept[1].start >= plain[1].start + 25  # the window of noise before it is not decoded
    single = plan_windows(HELLO, vad, pack=False)
    assert [w.spans for w in single] == [w.spans for w in plan_windows(HELLO)]  # ≤ 30 s: as without VAD
    packed = plan_windows(audio, vad)  # pack: only the two utterances, in one window
    assert len(packed) == 1 and len(packed[0].spans) == 2
    # no speech at all: no window, as under pack
    assert plan_windows(noise, vad, pack=False) == []
    # one request, three items, each by its mode
    buffer = io.BytesIO()
    soundfile.write(buffer, audio, SAMPLE_RATE, subtype="FLOAT", format="WAV")
    items = np.array([buffer.getvalue()] * 3, dtype=object)
    counts = [len(features) for features, _ in request_features(items, ["off", "windows", "pack"], filters, vad)]
    assert counts == [3, 2, 1]


@pytest.mark.parametrize("vad_filter", [None, True])
def test_a_stream_request_without_speech_is_one_empty_final_response(vad, filters, vad_filter):
    """speech_recognition_stream's planning and decode on noise under VAD (its default, and
    vad_filter true): no window, nothing decoded, one final response with an empty transcript (stop
    38: planning raised IndexError on the 0 windows, and its traceback reached the /v1 client)."""
    from triton_pipelines.pipelines.speech.streaming import StreamDecode, plan_stream_job

    tokenizer = WhisperTokenizer(whisper_assets_dir() / "multilingual.tiktoken")
    buffer = io.BytesIO()
    noise = (0.05 * np.random.default_rng(2).standard_normal(3 * SAMPLE_RATE)).astype(np.float32)
    soundfile.write(buffer, noise, SAMPLE_RATE, format="WAV")
    raw = None if vad_filter is None else np.array([[vad_filter]])
    job = plan_stream_job(tokenizer, filters, np.array([buffer.getvalue()], dtype=object), None, None, None, None, raw,
                          parameters={}, limits={}, vad=vad, vad_default=DEFAULT_VAD_MODE)
    assert job.features.shape[0] == 0 and job.spans == [] and job.duration == 3.0  # the clip's, not its windows'
    sent = []

    def no_decode(*args):
        raise AssertionError("nothing to decode")

    StreamDecode(tokenizer, [job], 4, no_decode, lambda i, outputs, final: sent.append((i, outputs, final))).run()
    assert len(sent) == 1 and sent[0][2] and sent[0][1]["transcript"][0, 0] == b""
    assert float(sent[0][1]["duration"][0, 0]) == 3.0  # verbose_json's duration
