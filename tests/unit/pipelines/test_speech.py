"""Unit tests for the speech pipeline logic (triton_pipelines.pipelines.speech): no server."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile

from repo_builder.speech_pipeline import whisper_assets_dir
from triton_pipelines.errors import InputError, UpstreamError
from triton_pipelines.pipelines.onnx_runner import InputCache
from triton_pipelines.pipelines.speech.audio import decode_audio
from triton_pipelines.pipelines.speech.config import MAX_TARGET_POSITIONS, SAMPLE_RATE, WINDOW_SAMPLES
from triton_pipelines.pipelines.speech.decoding import GreedyBatch, GreedyDecoder, cross_names
from triton_pipelines.pipelines.speech.features import load_mel_filters, log_mel_spectrogram
from triton_pipelines.errors import RequestCancelled
from triton_pipelines.pipelines.speech.jobs import (CancelWatch, DecodeJob, client_gone, deadline_passed,
                                                    decode_group_size, decode_jobs, group_windows,
                                                    join_transcript, plan_request, transcript_outputs)
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer, suppress_mask
from triton_pipelines.pipelines.speech.windows import (SEAM_QUIET_SECONDS, SEAM_SEARCH_SECONDS, pad_windows,
                                                       split_windows)
from tests.support.paths import TEST_DATA

DATA = TEST_DATA


@pytest.fixture(scope="module")
def filters() -> np.ndarray:
    return load_mel_filters(whisper_assets_dir() / "mel_filters.npz", 80)


@pytest.fixture(scope="module")
def tokenizer() -> WhisperTokenizer:
    return WhisperTokenizer(whisper_assets_dir() / "multilingual.tiktoken")


def wav_bytes(samples: np.ndarray, rate: int = SAMPLE_RATE, subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, subtype=subtype, format=fmt)
    return buffer.getvalue()


def tone(seconds: float, rate: int = SAMPLE_RATE, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


# --- features ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_matches_hugging_face_feature_extractor(n_mels):
    from transformers import WhisperFeatureExtractor

    speech = decode_audio((DATA / "speech_hello.wav").read_bytes())
    noise = np.random.default_rng(0).standard_normal(SAMPLE_RATE // 2).astype(np.float32) * 0.1
    clips = [speech, tone(2.0), noise, np.zeros(SAMPLE_RATE, np.float32)]
    filters = load_mel_filters(whisper_assets_dir() / "mel_filters.npz", n_mels)
    ours = np.stack([log_mel_spectrogram(c, filters) for c in clips])
    reference = WhisperFeatureExtractor(feature_size=n_mels)(
        clips, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features
    assert ours.shape == reference.shape == (len(clips), n_mels, 3000)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)


def test_long_audio_is_cut_in_pauses_into_windows_of_at_most_30_s():
    """Each cut lies in the quietest stretch of the window's last SEAM_SEARCH_SECONDS (here the
    pauses placed there), every sample lands in exactly one window, none is longer than 30 s."""
    rng = np.random.default_rng(0)
    audio = (0.3 * rng.standard_normal(int(75 * SAMPLE_RATE))).astype(np.float32)
    pauses = [(27.0, 27.5), (55.2, 55.6)]  # the second window starts at the first cut
    for start, stop in pauses:
        audio[int(start * SAMPLE_RATE):int(stop * SAMPLE_RATE)] *= 1e-3
    windows = split_windows(audio)
    np.testing.assert_array_equal(np.concatenate(windows), audio)
    assert all(len(w) <= WINDOW_SAMPLES for w in windows) and len(windows) == 3
    cuts = np.cumsum([len(w) for w in windows])[:-1] / SAMPLE_RATE
    for cut, (start, stop) in zip(cuts, pauses):
        assert start + SEAM_QUIET_SECONDS / 2 <= cut <= stop - SEAM_QUIET_SECONDS / 2, (cut, start, stop)
    # no pause at all: still windows of 30 - SEAM_SEARCH_SECONDS .. 30 s that cover everything
    steady = np.ones(int(2.5 * WINDOW_SAMPLES), np.float32)
    windows = split_windows(steady)
    assert all(WINDOW_SAMPLES - SEAM_SEARCH_SECONDS * SAMPLE_RATE <= len(w) <= WINDOW_SAMPLES for w in windows[:-1])
    assert sum(len(w) for w in windows) == len(steady) and len(windows) == 3
    assert [len(w) for w in split_windows(np.zeros(10, np.float32))] == [10]
    assert [len(w) for w in split_windows(np.zeros(WINDOW_SAMPLES, np.float32))] == [WINDOW_SAMPLES]


def test_pad_windows_pads_items_to_the_longest():
    stacked, counts = pad_windows([np.ones((2, 80, 3000), np.float32), np.ones((1, 80, 3000), np.float32)])
    assert stacked.shape == (2, 2, 80, 3000) and counts.tolist() == [2, 1]
    assert stacked[1, 1].sum() == 0 and stacked[1, 0].sum() == 80 * 3000


# --- audio decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("subtype", ["PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT"])
def test_sample_formats_decode_to_the_same_waveform(subtype):
    original = tone(1.0)
    decoded = decode_audio(wav_bytes(original, subtype=subtype))
    assert decoded.dtype == np.float32 and decoded.shape == original.shape
    tolerance = 1.5 / 128 if subtype == "PCM_U8" else 1e-4
    np.testing.assert_allclose(decoded, original, atol=tolerance)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_other_sample_rates_are_resampled_to_16k(rate, filters):
    decoded = decode_audio(wav_bytes(tone(1.0, rate), rate=rate))
    assert abs(len(decoded) - SAMPLE_RATE) <= 1
    expected = tone(1.0)
    # soxr HQ: a 440 Hz tone survives resampling almost exactly (edges excluded)
    np.testing.assert_allclose(decoded[200:-200], expected[200:len(decoded) - 200], atol=2e-3)


def test_stereo_is_averaged_to_mono():
    left, right = tone(0.5, freq=300), tone(0.5, freq=900)
    decoded = decode_audio(wav_bytes(np.stack([left, right], axis=1), subtype="FLOAT"))
    np.testing.assert_allclose(decoded, (left + right) / 2, atol=1e-6)


@pytest.mark.parametrize("fmt,subtype", [("FLAC", "PCM_16"), ("OGG", "VORBIS")])
def test_flac_and_ogg_decode(fmt, subtype):
    decoded = decode_audio(wav_bytes(tone(1.0), subtype=subtype, fmt=fmt))
    assert abs(len(decoded) - SAMPLE_RATE) < 200 and np.abs(decoded).max() > 0.1


@pytest.mark.parametrize("data,message", [
    (b"", r"'audio'\[0\] is empty \(0 bytes\)"),
    (b"RIFF....WAVEfmt garbage that is not audio", r"'audio'\[0\] is not a decodable audio file"),
    (b"\x00\x01" * 500, r"'audio'\[0\] is not a decodable audio file"),
    (wav_bytes(np.zeros(0, np.float32)), r"'audio'\[0\] contains no audio samples"),
])
def test_bad_audio_is_refused_with_a_clear_message(data, message):
    with pytest.raises(InputError, match=message):
        decode_audio(data)


def test_too_long_audio_is_refused_before_decoding():
    ten_minutes = wav_bytes(np.zeros(600 * 8000, np.float32), rate=8000, subtype="PCM_U8")
    with pytest.raises(InputError, match=r"'audio'\[3\] is 600.0 s long; the limit is 300 s"):
        decode_audio(ten_minutes, index=3)
    with pytest.raises(InputError, match="the limit is 1000 bytes"):
        decode_audio(wav_bytes(tone(1.0)), max_bytes=1000)


def test_non_finite_float_samples_are_refused():
    samples = tone(0.2)
    samples[10] = np.nan
    with pytest.raises(InputError, match="NaN or infinite"):
        decode_audio(wav_bytes(samples, subtype="FLOAT"))


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_special_ids_match_openai_whisper(tokenizer):
    # The ids openai-whisper's get_tokenizer(multilingual=True) gives (tiny ... large-v2).
    assert tokenizer.n_vocab == 51865
    assert (tokenizer.eot, tokenizer.sot, tokenizer.no_timestamps) == (50257, 50258, 50363)
    assert tokenizer.prompt("en", "transcribe") == [50258, 50259, 50359, 50363]
    assert tokenizer.prompt("de", "translate") == [50258, 50261, 50358, 50363]


def test_large_v3_tokenizer_has_100_languages():
    large = WhisperTokenizer.for_vocab_size(whisper_assets_dir() / "multilingual.tiktoken", 51866)
    assert large.n_vocab == 51866 and large.special["<|yue|>"] == 50358
    assert large.prompt("en") == [50258, 50259, 50360, 50364]


def test_detokenizing_known_ids_gives_known_text(tokenizer):
    # " Hello world." in Whisper's multilingual vocabulary, between a prompt and <|endoftext|>.
    assert tokenizer.encode(" Hello world.") == [2425, 1002, 13]
    assert tokenizer.decode([50258, 50259, 50359, 50363, 2425, 1002, 13, 50257]) == " Hello world."
    for text in (" Guten Morgen, wie geht's?", " こんにちは世界", " Ça va très bien."):
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_unknown_language_or_task_is_an_input_error(tokenizer):
    with pytest.raises(InputError, match="unknown language 'klingon'"):
        tokenizer.prompt("klingon")
    with pytest.raises(InputError, match="unknown task 'summarize'"):
        tokenizer.prompt("en", "summarize")


def test_join_transcript_strips_and_joins_windows(tokenizer):
    windows = [tokenizer.encode(" Hello world."), [], tokenizer.encode(" Second window.")]
    assert join_transcript(tokenizer, windows) == "Hello world. Second window."


# --- greedy state machine -----------------------------------------------------------------------


def logits_for(tokens: list[int], vocab: int = 51865) -> np.ndarray:
    logits = np.zeros((len(tokens), vocab), np.float32)
    logits[np.arange(len(tokens)), tokens] = 1.0
    return logits


def test_greedy_batch_stops_at_eot_and_max_tokens_and_compacts(tokenizer):
    eot = tokenizer.eot
    prompts = np.array([tokenizer.prompt()] * 3)
    state = GreedyBatch(prompts, eot, np.array([5, 2, 5]), suppress_mask(51865, eot))
    assert state.next_ids.shape == (3, 4)
    assert state.advance(logits_for([10, 11, 12])) is None  # nobody finished
    assert state.next_ids.tolist() == [[10], [11], [12]]
    rows = state.advance(logits_for([eot, 21, 22]))  # window 0: eot; window 1: its 2-token bound
    assert rows.tolist() == [2] and state.active.tolist() == [2] and state.next_ids.tolist() == [[22]]
    assert state.advance(logits_for([eot])).tolist() == []
    assert state.done and state.tokens == [[10], [11, 21], [12, 22]]


def test_greedy_batch_suppresses_special_tokens_except_eot(tokenizer):
    state = GreedyBatch(np.array([tokenizer.prompt()]), tokenizer.eot, 3, suppress_mask(51865, tokenizer.eot))
    logits = np.zeros((1, 51865), np.float32)
    logits[0, tokenizer.no_timestamps] = 5.0  # suppressed
    logits[0, 7] = 1.0
    state.advance(logits)
    assert state.tokens == [[7]]


def test_greedy_batch_applies_whispers_suppression_and_the_first_token_rule(tokenizer):
    """The served masks: non-speech symbols never; a blank or <|endoftext|> not as the first token
    (Whisper's suppress_blank), both allowed afterwards."""
    mask, begin = tokenizer.suppress_masks(51865)
    state = GreedyBatch(np.array([tokenizer.prompt()] * 2), tokenizer.eot, 5, mask, begin_mask=begin)
    blank, symbol = tokenizer.encode(" ")[0], tokenizer.non_speech_tokens[0]
    first = np.zeros((2, 51865), np.float32)
    first[0, tokenizer.eot], first[0, 50] = 9.0, 1.0  # eot first → suppressed, 50 wins
    first[1, blank], first[1, symbol], first[1, 70] = 9.0, 8.0, 1.0  # blank and symbol suppressed
    state.advance(first)
    assert state.tokens == [[50], [70]]
    later = np.zeros((2, 51865), np.float32)
    later[0, blank], later[1, tokenizer.eot] = 9.0, 9.0
    state.advance(later)
    assert state.tokens == [[50, blank], [70]] and state.active.tolist() == [0]


def test_greedy_batch_without_compaction_keeps_rows(tokenizer):
    eot = tokenizer.eot
    state = GreedyBatch(np.array([tokenizer.prompt()] * 2), eot, 3, suppress_mask(51865, eot), compact=False)
    assert state.advance(logits_for([eot, 5])) is None and state.next_ids.shape == (2, 1)
    state.advance(logits_for([9, 6]))
    state.advance(logits_for([9, 7]))
    assert state.done and state.tokens == [[], [5, 6, 7]]


def test_plan_request_validates_and_expands_per_window(tokenizer):
    features = np.zeros((2, 2, 80, 3000), np.float32)
    job = plan_request(tokenizer, features, np.array([[2], [1]], np.int32),
                       language=np.array([[b"de"], [b""]], dtype=object),
                       max_new_tokens=np.array([[7], [3]], np.int32))
    assert job.features.shape == (3, 80, 3000) and job.windows_per_item == [2, 1]
    assert job.prompts[:, 1].tolist() == [50261, 50261, -1]  # de, de, detected (the default: auto)
    assert job.max_new_tokens.tolist() == [7, 7, 3]
    with pytest.raises(InputError, match="num_windows"):
        plan_request(tokenizer, features, np.array([[3], [1]], np.int32))
    with pytest.raises(InputError, match=f"max_new_tokens' must hold one value in 1..{MAX_TARGET_POSITIONS - 4}"):
        plan_request(tokenizer, features, None, max_new_tokens=np.array([[0], [5]], np.int32))
    with pytest.raises(InputError, match="unknown language 'xx'"):
        plan_request(tokenizer, features, None, language=np.array([[b"en"], [b"xx"]], dtype=object))


def test_group_windows():
    assert group_windows([[1], [2], [3]], [2, 1]) == [[[1], [2]], [[3]]]


# --- the greedy loop shared by whisper_decode and the in-process reference -----------------------

VOCAB = 51865
SCRIPTS = {0: [1011, 1012, 1013], 1: [1021], 2: [1031, 1032, 1033, 1034, 1035], 3: [1041]}  # then eot


STATE = {"past_self_kv": "present_self_kv"}


class CachingStep:
    """A stand-in decoder step behind the embedded runner's cache: with ``cache`` it keeps the
    cross K/V and the self-attention K/V per key as ``EmbeddedComputeModel`` does (``InputCache``
    with the state pair ``past_self_kv=present_self_kv``); ``forget_at``: the call at which it loses
    them (another instance, eviction, restart). ``compute(input_ids, past, cross)`` → (logits, present)."""

    def __init__(self, compute, cache=False, forget_at=None):
        self.compute, self.calls, self.forget_at = compute, [], forget_at
        self.cache = InputCache(cross_names(1), states=STATE) if cache else None

    def __call__(self, input_ids, past, cross, parameters):
        self.calls.append((len(input_ids), sorted(cross), dict(parameters), input_ids.shape[1], past is not None))
        if self.cache is None:
            return self.compute(input_ids, past, cross)
        if len(self.calls) == self.forget_at:
            self.cache = InputCache(cross_names(1), states=STATE)
        rows, key = parameters.get("input_cache_rows"), parameters["input_cache_key"]
        given = dict(cross) if past is None else {**cross, "past_self_kv": past}
        try:
            feeds = self.cache.resolve(key, given, [int(r) for r in rows.split(",")] if rows else None)
        except InputError as error:
            raise UpstreamError(f"whisper_decoder failed: {error}") from None
        logits, present = self.compute(input_ids, feeds.pop("past_self_kv"), feeds)
        self.cache.store_state(key, {"logits": logits, "present_self_kv": present})
        return logits, None  # the caller asked for the logits only


class ScriptedDecoder(CachingStep):
    """Row r's window is the value of its cross K/V; the position comes from the self-attention
    cache's length."""

    def __init__(self, eot, cache=False, forget_at=None):
        super().__init__(self.scripted, cache, forget_at)
        self.eot = eot

    def scripted(self, input_ids, past, cross):
        present = np.concatenate([past, np.zeros((*past.shape[:3], input_ids.shape[1], past.shape[4]),
                                                 np.float32)], axis=3)
        position = present.shape[3] - 4
        windows = cross["cross_key_0"][:, 0, 0, 0].astype(int)
        tokens = [SCRIPTS[w][position] if position < len(SCRIPTS[w]) else self.eot for w in windows]
        return logits_for(tokens, VOCAB), present


class HistoryDecoder(CachingStep):
    """The next token depends on every token so far (kept in the self-attention cache, one value per
    position) and on the window (its cross K/V): a decoder that lost its cache and is given the
    wrong history, or the wrong rows, answers other tokens. Window w stops after 3 + 2 w tokens."""

    def __init__(self, eot, cache=False, forget_at=None):
        super().__init__(self.history, cache, forget_at)
        self.eot = eot

    def history(self, input_ids, past, cross):
        new = np.zeros((*past.shape[:3], input_ids.shape[1], past.shape[4]), np.float32)
        new[:, 0, 0, :, 0] = input_ids
        present = np.concatenate([past, new], axis=3)
        seen = present[:, 0, 0, :, 0].astype(np.int64)  # [rows, positions]: every token so far
        windows = cross["cross_key_0"][:, 0, 0, 0].astype(int)
        tokens = [self.eot if seen.shape[1] - 4 >= 3 + 2 * w else
                  1000 + int((seen[row] * np.arange(1, seen.shape[1] + 1)).sum() % 997) + 7 * w
                  for row, w in enumerate(windows)]
        return logits_for(tokens, VOCAB), present


def decode_scripted(tokenizer, step, compact=True, **options):
    windows = np.arange(len(SCRIPTS), dtype=np.float32)
    cross = {name: np.broadcast_to(windows[:, None, None, None], (len(windows), 2, 3, 5)).copy()
             for name in cross_names(1)}
    decoder = GreedyDecoder(tokenizer, VOCAB, step, **options)
    return decoder.decode(np.array([tokenizer.prompt()] * len(windows)), 4, cross, heads=2, head_dim=5,
                          compact=compact)


EXPECTED = [[1011, 1012, 1013], [1021], [1031, 1032, 1033, 1034], [1041]]  # window 2 stops at its bound of 4


def test_greedy_decoder_sends_only_the_running_windows(tokenizer):
    step = ScriptedDecoder(tokenizer.eot)
    assert decode_scripted(tokenizer, step) == EXPECTED
    assert [rows for rows, *_ in step.calls] == [4, 4, 2, 2]
    assert all(names == cross_names(1) and parameters == {} for _, names, parameters, *_ in step.calls)


def test_a_client_gone_while_the_encoder_ran_costs_no_decoder_step(tokenizer):
    """The first on_step comes before the first step: a 120 s clip's encoder call takes seconds on
    a CPU, and a client that left meanwhile must not pay a decoder step (test_hostile_cancel saw one)."""
    step = ScriptedDecoder(tokenizer.eot)
    windows = np.arange(len(SCRIPTS), dtype=np.float32)
    cross = {name: np.broadcast_to(windows[:, None, None, None], (len(windows), 2, 3, 5)).copy()
             for name in cross_names(1)}
    seen = []

    def gone(state):
        seen.append([len(t) for t in state.tokens])
        state.stop(range(len(state.tokens)))

    tokens = GreedyDecoder(tokenizer, VOCAB, step).decode(np.array([tokenizer.prompt()] * len(windows)), 4, cross,
                                                          heads=2, head_dim=5, on_step=gone)
    assert step.calls == [] and seen == [[0] * len(windows)] and tokens == [[]] * len(windows)


def test_greedy_decoder_without_compaction_keeps_every_row(tokenizer):
    step = ScriptedDecoder(tokenizer.eot)
    assert decode_scripted(tokenizer, step, compact=False) == EXPECTED
    assert {rows for rows, *_ in step.calls} == {4}


def test_greedy_decoder_sends_the_cross_kv_and_past_once_to_a_caching_decoder(tokenizer):
    step = ScriptedDecoder(tokenizer.eot, cache=True)
    assert decode_scripted(tokenizer, step, cache_key="me") == EXPECTED
    assert step.calls[0][1] == cross_names(1) and all(names == [] for _, names, *_ in step.calls[1:])
    # the zero-length past on the first step only; later steps send one new token per row
    assert [(width, past) for *_, width, past in step.calls] == [(4, True), (1, False), (1, False), (1, False)]
    assert [parameters["input_cache_rows"] for _, _, parameters, *_ in step.calls] == \
        ["0,1,2,3", "0,1,2,3", "0,2", "0,2"]
    assert {parameters["input_cache_key"] for _, _, parameters, *_ in step.calls} == {"me"}


def test_greedy_decoder_starts_the_running_windows_again_on_a_decoder_without_them(tokenizer):
    step = ScriptedDecoder(tokenizer.eot, cache=True, forget_at=3)
    assert decode_scripted(tokenizer, step, cache_key="me") == EXPECTED
    # call 3 (rows 0 and 2) is not cached; call 4 sends their cross K/V, a zero-length past and
    # prompt + the 2 tokens each generated; the next step is incremental again
    assert [(rows, names, width, past) for rows, names, _, width, past in step.calls[2:]] == \
        [(2, [], 1, False), (2, cross_names(1), 6, True), (2, [], 1, False)]


@pytest.mark.parametrize("forget_at", [2, 3, 4, 99])
def test_greedy_decoder_recovery_gives_the_tokens_of_the_uncached_path(tokenizer, forget_at):
    expected = decode_scripted(tokenizer, HistoryDecoder(tokenizer.eot))
    assert [len(tokens) for tokens in expected] == [3, 4, 4, 4]  # windows 1-3 stop at the bound of 4
    assert len(set(t for tokens in expected for t in tokens)) > 8
    step = HistoryDecoder(tokenizer.eot, cache=True, forget_at=forget_at)
    assert decode_scripted(tokenizer, step, cache_key="me") == expected
    resent = [index for index, (_, names, *_) in enumerate(step.calls) if names and index > 0]
    assert resent == ([] if forget_at == 99 else [forget_at])


def test_greedy_decoder_with_a_cache_that_keeps_nothing_starts_again_every_step(tokenizer):
    """input_cache_entries 0: every later step is answered NOT_CACHED and starts again (same tokens)."""
    expected = decode_scripted(tokenizer, HistoryDecoder(tokenizer.eot))
    step = HistoryDecoder(tokenizer.eot, cache=True)
    step.cache = InputCache(cross_names(1), max_entries=0, states=STATE)
    assert decode_scripted(tokenizer, step, cache_key="me") == expected


def test_history_is_prompt_and_tokens_and_pads_finished_rows(tokenizer):
    state = GreedyBatch(np.array([[1, 2, 3, 4], [5, 6, 7, 8]]), tokenizer.eot, 5, np.zeros(VOCAB, np.float32),
                        compact=False)
    state.advance(logits_for([1001, tokenizer.eot], VOCAB))
    state.advance(logits_for([1002, 1003], VOCAB))
    assert state.history().tolist() == [[1, 2, 3, 4, 1001, 1002], [5, 6, 7, 8, tokenizer.eot, tokenizer.eot]]


def test_greedy_decoder_passes_on_other_decoder_failures(tokenizer):
    def broken(*_):
        raise UpstreamError("whisper_decoder failed: boom")

    with pytest.raises(UpstreamError, match="boom"):
        decode_scripted(tokenizer, broken, cache_key="me")


def test_decode_jobs_decodes_in_groups_and_regroups_per_item():
    jobs = [DecodeJob(np.arange(3, dtype=np.float32)[:, None, None], np.zeros((3, 4), np.int64),
                      np.full(3, 5), [2, 1]),
            DecodeJob(np.arange(3, 5, dtype=np.float32)[:, None, None], np.zeros((2, 4), np.int64),
                      np.full(2, 5), [2])]
    groups = []

    def decode_group(features, prompts, bounds, on_step):
        groups.append(features[:, 0, 0].tolist())
        return [[int(f)] for f in features[:, 0, 0]]

    assert decode_jobs(jobs, 2, decode_group) == [[[[0], [1]], [[2]]], [[[3], [4]]]]
    assert groups == [[0, 1], [2, 3], [4]]


def counting_group(steps: list):
    """A decode_group whose windows would each run 100 steps; ``steps`` gets the running windows'
    features (their ids) at every step."""
    def group(features, prompts, bounds, on_step):
        state = GreedyBatch(prompts, 0, 100, np.zeros(8, np.float32))
        while not state.done:
            steps.append([int(features[w, 0, 0]) for w in state.active])
            logits = np.zeros((len(state.active), 8), np.float32)
            logits[:, 3] = 1.0  # never <|endoftext|> (0)
            state.advance(logits)
            on_step(state)
        return state.tokens
    return group


def test_a_job_whose_client_has_gone_gets_no_more_steps_and_its_neighbour_is_decoded():
    gone_after = {"steps": 3}
    steps: list = []
    jobs = [DecodeJob(np.array([0., 1., 2.], np.float32)[:, None, None], np.zeros((3, 4), np.int64),
                      np.full(3, 100), [3], cancelled=lambda: len(steps) >= gone_after["steps"]),
            DecodeJob(np.array([3.], np.float32)[:, None, None], np.zeros((1, 4), np.int64), np.full(1, 100), [1])]
    watch = CancelWatch(lambda index: jobs[index].cancelled(), interval=0.0)
    gone, served = decode_jobs(jobs, 2, counting_group(steps), watch)
    assert isinstance(gone, RequestCancelled) and "client has gone" in str(gone)
    assert served == [[[3] * 100]]  # the neighbour's window ran to its bound
    # the first group (windows 0 and 1) ended at the step that saw the client gone; window 2, in
    # the neighbour's group, is stopped at its first step and leaves the batch at the next one;
    # window 3 (the neighbour) runs on alone
    assert steps == [[0, 1]] * 3 + [[2, 3]] * 2 + [[3]] * 98


def test_a_group_of_only_gone_jobs_is_not_decoded():
    steps: list = []
    jobs = [DecodeJob(np.zeros((2, 1, 1), np.float32), np.zeros((2, 4), np.int64), np.full(2, 100), [2],
                      cancelled=lambda: True)]
    assert isinstance(decode_jobs(jobs, 2, counting_group(steps))[0], RequestCancelled) and steps == []


def test_cancel_watch_asks_at_most_once_per_interval_and_gone_stays_gone():
    now, asked, answer = [0.0], [], [False]
    watch = CancelWatch(lambda index: asked.append(index) or answer[0], interval=0.1, clock=lambda: now[0])
    assert not watch(0) and not watch(0) and asked == [0]  # the second question is not asked
    answer[0] = True
    now[0] = 0.05
    assert not watch(0) and asked == [0]
    now[0] = 0.1
    assert watch(0) and asked == [0, 0]
    answer[0] = False
    now[0] = 1.0
    assert watch(0) and asked == [0, 0]  # gone: not asked again
    assert not watch(1) and asked == [0, 0, 1]  # per request


def test_a_forwarded_deadline_that_has_passed_means_the_client_has_gone():
    from triton_pipelines.limits import CLIENT_DEADLINE_PARAMETER

    asked = []
    parameters = {CLIENT_DEADLINE_PARAMETER: "1000"}
    assert deadline_passed(parameters, 1000) and not deadline_passed(parameters, 999)
    assert not deadline_passed({}, 10**20)
    assert not deadline_passed({CLIENT_DEADLINE_PARAMETER: "soon"}, 10**20)
    gone = client_gone(parameters, lambda: asked.append(1) or False, clock=lambda: 2000)
    assert gone() and asked == []  # past the deadline: Triton is not asked
    waiting = client_gone(parameters, lambda: asked.append(1) or True, clock=lambda: 10)
    assert waiting() and asked == [1]  # before it: cancelled by Triton
    assert not client_gone({}, lambda: False)()


def test_a_group_is_one_encoder_calls_worth_on_both_targets():
    assert decode_group_size(64, 4) == 4  # embedded: no join of several encoder calls
    assert decode_group_size(64, 8) == 8  # gpu
    assert decode_group_size(2, 8) == 2


def test_transcript_outputs(tokenizer):
    hello, world = tokenizer.encode(" Hello"), tokenizer.encode(" world")
    outputs = transcript_outputs(tokenizer, [[hello, world], [[]]])
    assert outputs["transcript"].tolist() == [[b"Hello world"], [b""]]
    assert outputs["token_ids"].dtype == np.int32
    assert outputs["token_ids"].tolist() == [hello + world, [-1] * len(hello + world)]


# --- builder: both targets from one description (large-v3 is described, never exported here) -----


def test_gpu_target_describes_large_v3_configs_without_exporting(monkeypatch, tmp_path):
    import argparse

    from tritonclient.grpc import model_config_pb2 as mc

    from repo_builder.pipeline import BuildContext
    from repo_builder.speech_pipeline import SpeechPipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub, an empty cache: the gpu default falls back
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    pipeline = SpeechPipeline()
    context = lambda target, model=None: BuildContext(  # noqa: E731
        target=target, output=Path("/nonexistent"), args=argparse.Namespace(whisper_model=model), root=Path.cwd())
    gpu = context("gpu", "random:large-v3")  # the architecture of openai/whisper-large-v3, the gpu default
    encoder, decoder = pipeline.compute_models(gpu)
    encoder_config, decoder_config = encoder.config("gpu"), decoder.config("gpu")
    assert encoder_config.platform == decoder_config.platform == "onnxruntime_onnx"
    assert decoder_config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    assert list(encoder_config.input[0].dims) == [128, 3000]
    assert len(encoder_config.output) == 64 and list(encoder_config.output[0].dims) == [20, 64, 1500]
    assert [t.name for t in decoder_config.input][:2] == ["input_ids", "past_self_kv"]
    assert list(decoder_config.input[1].dims) == [64, 20, -1, 64] and len(decoder_config.input) == 66
    assert list(decoder_config.output[0].dims) == [51866]
    embedded = context("embedded")
    base_encoder, base_decoder = pipeline.compute_models(embedded)  # the default: real Whisper base
    assert base_encoder.config("embedded").backend == "python"
    # one description: same tensors on both targets; on the embedded target the cross K/V are
    # also optional (a BLS caller may name the runner's cached copy instead)
    embedded_inputs, gpu_inputs = base_decoder.config("embedded").input, base_decoder.config("gpu").input
    assert [(t.name, t.data_type, list(t.dims)) for t in embedded_inputs] == \
        [(t.name, t.data_type, list(t.dims)) for t in gpu_inputs]
    assert list(embedded_inputs[1].dims) == [12, 8, -1, 64]
    assert [t.name for t in embedded_inputs if t.optional] == ["past_self_kv", *cross_names(6)]
    assert base_decoder.config("embedded").parameters["state_inputs"].string_value == "past_self_kv=present_self_kv"
    assert "state_inputs" not in base_decoder.config("gpu").parameters
    assert not any(t.optional for t in gpu_inputs)
    assert base_decoder.config("embedded").parameters["cached_inputs"].string_value == ",".join(cross_names(6))
    assert pipeline.model_table(gpu)[0]["architecture"].startswith("Whisper large-v3")
    assert pipeline.model_table(gpu)[0]["random"]
    assert pipeline.model_table(embedded)[0]["architecture"].startswith("Whisper base")
    assert pipeline.model_table(embedded)[0]["kind"] == "package"
    # the gpu default without a hub: the packaged real base, with its configs
    assert [row["kind"] for row in pipeline.model_table(context("gpu"))] == ["package", "package"]
    assert list(pipeline.compute_models(context("gpu"))[0].config("gpu").input[0].dims) == [80, 3000]
    # an explicit size: that architecture with random weights (fast tests)
    tiny = context("embedded", "random:tiny")
    assert pipeline.compute_models(tiny)[1].source_key != base_decoder.source_key
    assert list(pipeline.compute_models(tiny)[1].config("embedded").input[1].dims) == [8, 6, -1, 64]
