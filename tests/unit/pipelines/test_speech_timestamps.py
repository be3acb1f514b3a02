"""Language detection and timestamps in the greedy state machine (``GreedyBatch``), Whisper's
timestamp rules (``TimestampRules``, openai-whisper's ``ApplyTimestampRules``), and a window's
tokens → segments."""

from __future__ import annotations

import numpy as np
import pytest

from repo_builder.speech_pipeline import whisper_assets_dir
from triton_pipelines.pipelines.speech.decoding import GreedyBatch, GreedyDecoder, cross_names, fill_languages
from triton_pipelines.pipelines.speech.timestamps import MAX_INITIAL_TIMESTAMP_INDEX, TIME_PRECISION, window_segments
from triton_pipelines.pipelines.speech.tokenizer import TIMESTAMPS_SLOT, WhisperTokenizer, detect_from

VOCAB = 51865


@pytest.fixture(scope="module")
def tokenizer() -> WhisperTokenizer:
    return WhisperTokenizer(whisper_assets_dir() / "multilingual.tiktoken")


@pytest.fixture(scope="module")
def rules(tokenizer):
    return tokenizer.timestamp_rules(VOCAB)


def ts(tokenizer, seconds: float) -> int:
    return tokenizer.timestamp_begin + int(round(seconds / TIME_PRECISION))


def choose(rules, logits: np.ndarray, generated: list[int]) -> int:
    row = logits + (rules.begin if not generated else rules.mask)
    rules.apply(row, generated)
    return int(np.argmax(row))


def test_the_first_token_is_a_timestamp_of_at_most_one_second(tokenizer, rules):
    logits = np.zeros(VOCAB, np.float32)
    logits[500] = 9.0  # a text token
    logits[ts(tokenizer, 2.0)] = 8.0  # too late to start
    logits[ts(tokenizer, 0.4)] = 1.0
    assert choose(rules, logits, []) == ts(tokenizer, 0.4)
    assert MAX_INITIAL_TIMESTAMP_INDEX == 50


def test_timestamps_come_in_pairs_and_never_decrease(tokenizer, rules):
    start, text = ts(tokenizer, 1.0), 500  # (every other token unlikely: the timestamps' sum stays low)
    logits = np.full(VOCAB, -30.0, np.float32)
    logits[ts(tokenizer, 0.5)] = 9.0  # earlier than the segment's start: never
    logits[text + 1] = 5.0
    assert choose(rules, logits, [start]) == text + 1  # after one timestamp: text
    logits = np.full(VOCAB, -30.0, np.float32)
    logits[start] = 9.0  # a segment may not end where it started
    logits[ts(tokenizer, 2.0)] = 6.0
    logits[text] = 7.0
    assert choose(rules, logits, [start, text]) == text
    logits[text] = 0.0
    assert choose(rules, logits, [start, text]) == ts(tokenizer, 2.0)
    # after text and a closing timestamp: no text, a timestamp (equal allowed) or <|endoftext|>
    closing = [start, text, ts(tokenizer, 2.0)]
    logits = np.full(VOCAB, -30.0, np.float32)
    logits[text], logits[ts(tokenizer, 2.0)] = 9.0, 3.0
    assert choose(rules, logits, closing) == ts(tokenizer, 2.0)
    logits[tokenizer.eot] = 4.0
    assert choose(rules, logits, closing) == tokenizer.eot
    # after two timestamps in a row: text, not a third timestamp
    logits = np.full(VOCAB, -30.0, np.float32)
    logits[ts(tokenizer, 3.0)], logits[text] = 9.0, 1.0
    assert choose(rules, logits, closing + [ts(tokenizer, 2.0)]) == text


def test_timestamps_together_more_probable_than_any_text_token_force_one(tokenizer, rules):
    logits = np.full(VOCAB, -30.0, np.float32)
    logits[500] = 2.0  # the best single token
    logits[ts(tokenizer, 1.5):ts(tokenizer, 4.5)] = 0.5  # 150 timestamps, each less likely
    assert choose(rules, logits, [ts(tokenizer, 1.0), 400]) == ts(tokenizer, 1.5)
    logits[ts(tokenizer, 1.5):ts(tokenizer, 4.5)] = -10.0  # together less likely: the text token
    assert choose(rules, logits, [ts(tokenizer, 1.0), 400]) == 500


def one_hot(rows: list[int]) -> np.ndarray:
    logits = np.zeros((len(rows), VOCAB), np.float32)
    logits[np.arange(len(rows)), rows] = 5.0
    return logits


def test_detection_feeds_the_start_token_alone_then_the_detected_prompt(tokenizer):
    """Two clips: the first of two windows (its second takes its language), one alone; the
    language is the argmax of the language tokens only (a text token scores higher)."""
    german, spanish = tokenizer.special["<|de|>"], tokenizer.special["<|es|>"]
    prompts = np.array([tokenizer.prompt_row("auto", window=0), tokenizer.prompt_row("auto", window=1),
                        tokenizer.prompt_row("auto", window=0)], dtype=np.int64)
    assert prompts[:, 1].tolist() == [detect_from(0), detect_from(1), detect_from(0)]
    mask, begin = tokenizer.suppress_masks(VOCAB)
    state = GreedyBatch(prompts, tokenizer.eot, 5, mask, begin_mask=begin, timestamps=tokenizer.timestamp_rules(VOCAB),
                        language_mask=tokenizer.language_mask(VOCAB))
    assert state.next_ids.tolist() == [[tokenizer.sot]] * 3
    logits = one_hot([german, spanish, spanish])
    logits[:, 700] = 9.0  # never a language
    assert state.advance(logits) is None and state.tokens == [[], [], []]
    assert prompts[:, 1].tolist() == [german, german, spanish]  # written in place
    transcribe = tokenizer.special["<|transcribe|>"]
    assert state.next_ids.tolist() == [[german, transcribe, tokenizer.no_timestamps]] * 2 + \
        [[spanish, transcribe, tokenizer.no_timestamps]]
    state.advance(one_hot([11, 12, 13]))
    assert state.tokens == [[11], [12], [13]] and state.fed == 4
    assert state.history().tolist()[2] == [tokenizer.sot, spanish, transcribe, tokenizer.no_timestamps, 13]


def test_fill_languages_takes_the_clips_first_window_from_an_earlier_group(tokenizer):
    german = tokenizer.special["<|de|>"]
    prompts = np.array([tokenizer.prompt_row("auto", window=w) for w in range(3)], dtype=np.int64)
    prompts[0, 1] = german  # detected in the first group
    fill_languages(prompts, 1, 3)
    assert prompts[:, 1].tolist() == [german, german, german]


def test_windows_with_and_without_timestamps_share_the_calls(tokenizer):
    """A timed window's prompt is one token shorter: the first call feeds the 3 common tokens, the
    next one feeds <|notimestamps|> to the other window while the timed one starts generating."""
    mask, begin = tokenizer.suppress_masks(VOCAB)
    prompts = np.array([tokenizer.prompt_row("en", timestamps=True), tokenizer.prompt_row("en")], dtype=np.int64)
    assert prompts[0, 3] == TIMESTAMPS_SLOT
    state = GreedyBatch(prompts, tokenizer.eot, 5, mask, begin_mask=begin, timestamps=tokenizer.timestamp_rules(VOCAB),
                        language_mask=tokenizer.language_mask(VOCAB))
    assert state.next_ids.shape == (2, 3)
    logits = one_hot([600, 600])
    logits[:, ts(tokenizer, 0.0)] = 4.0
    state.advance(logits)
    assert state.tokens == [[ts(tokenizer, 0.0)], []]  # the timed window must start with a timestamp
    assert state.next_ids.tolist() == [[ts(tokenizer, 0.0)], [tokenizer.no_timestamps]]
    state.advance(one_hot([601, 602]))
    assert state.tokens == [[ts(tokenizer, 0.0), 601], [602]]
    assert state.history().tolist() == [[*prompts[0, :3], ts(tokenizer, 0.0), 601], [*prompts[1], 602]]


def test_the_decoder_detects_in_one_call_for_the_whole_group(tokenizer):
    """GreedyDecoder: call 1 feeds <|startoftranscript|> for every window (one detecting, one
    given), call 2 the rest of both prompts, then one token per step."""
    calls, german = [], tokenizer.special["<|de|>"]

    def step(input_ids, past, cross, parameters):
        calls.append(input_ids.tolist())
        rows = len(input_ids)
        present = np.zeros((rows, 2, 1, past.shape[3] + input_ids.shape[1], 1), np.float32)
        if len(calls) == 1:
            return one_hot([german] * rows), present
        return one_hot([tokenizer.eot if len(calls) > 3 else 300 + len(calls)] * rows), present

    cross = {name: np.zeros((2, 1, 1, 1), np.float32) for name in cross_names(1)}
    prompts = np.array([tokenizer.prompt_row("auto"), tokenizer.prompt_row("es")], dtype=np.int64)
    tokens = GreedyDecoder(tokenizer, VOCAB, step).decode(prompts, 10, cross, heads=1, head_dim=1)
    assert [len(ids[0]) for ids in calls] == [1, 3, 1, 1]
    assert calls[1][0][0] == german and prompts[:, 1].tolist() == [german, tokenizer.special["<|es|>"]]
    assert tokens == [[302, 303]] * 2


def test_segments_follow_the_timestamp_pairs_within_the_window(tokenizer):
    text = lambda words: tokenizer.encode(words)  # noqa: E731
    tokens = [ts(tokenizer, 0.0), *text(" Hello there."), ts(tokenizer, 1.5), ts(tokenizer, 3.5),
              *text(" Second one."), ts(tokenizer, 5.0), ts(tokenizer, 6.0), *text(" Cut")]
    segments = window_segments(tokens, (30.0, 37.0), tokenizer.timestamp_begin, tokenizer.decode)
    assert [(s.start, s.end, s.text) for s in segments] == [
        (30.0, 31.5, "Hello there."), (33.5, 35.0, "Second one."), (36.0, 37.0, "Cut")]
    assert segments[0].tokens == tuple(text(" Hello there."))
    plain = window_segments(text(" No times."), (0.0, 4.0), tokenizer.timestamp_begin, tokenizer.decode)
    assert [(s.start, s.end, s.text) for s in plain] == [(0.0, 4.0, "No times.")]
    assert window_segments([ts(tokenizer, 0.0), ts(tokenizer, 1.0)], (0.0, 2.0), tokenizer.timestamp_begin,
                           tokenizer.decode) == []
