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


# --- word timestamps: DTW over the alignment heads' cross-attention -------------------------------
def reference_dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """openai-whisper's dtw_cpu and backtrace, written out cell by cell."""
    rows, cols = x.shape
    cost = np.ones((rows + 1, cols + 1), dtype=np.float32) * np.inf
    trace = -np.ones((rows + 1, cols + 1), dtype=np.float32)
    cost[0, 0] = 0
    for j in range(1, cols + 1):
        for i in range(1, rows + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = x[i - 1, j - 1] + c
            trace[i, j] = t
    i, j = rows, cols
    trace[0, :], trace[:, 0] = 2, 1
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        if trace[i, j] == 0:
            i, j = i - 1, j - 1
        elif trace[i, j] == 1:
            i -= 1
        else:
            j -= 1
    result = np.array(path)[::-1].T
    return result[0], result[1]


@pytest.mark.parametrize("shape", [(1, 1), (3, 40), (12, 97), (30, 31), (5, 5)])
def test_dtw_takes_openai_whispers_path(shape):
    from triton_pipelines.pipelines.speech.words import dtw

    rng = np.random.default_rng(shape[0] * 100 + shape[1])
    x = rng.standard_normal(shape).astype(np.float32)
    for matrix in (x, np.round(x)):  # with ties too
        ours, theirs = dtw(matrix), reference_dtw(matrix)
        assert ours[0].tolist() == theirs[0].tolist() and ours[1].tolist() == theirs[1].tolist()


def test_median_filter_is_torchs_reflect_padded_median():
    import torch
    import torch.nn.functional as F

    from triton_pipelines.pipelines.speech.words import median_filter

    x = np.random.default_rng(3).standard_normal((2, 6, 50)).astype(np.float32)
    padded = F.pad(torch.from_numpy(x), (3, 3, 0, 0), mode="reflect")
    expected = padded.unfold(-1, 7, 1).sort()[0][..., 3].numpy()
    np.testing.assert_allclose(median_filter(x, 7), expected, rtol=0, atol=0)


def test_words_split_at_spaces_and_punctuation(tokenizer):
    from triton_pipelines.pipelines.speech.words import split_words

    tokens = tokenizer.encode(" Hello, wonderful world.")
    words, ids = split_words([*tokens, tokenizer.eot], tokenizer.encoding.decode, tokenizer.eot, "en")
    assert words == [" Hello", ",", " wonderful", " world", ".", "<|endoftext|>"]
    assert sum(ids, []) == [*tokens, tokenizer.eot]


def test_find_alignment_follows_the_attention_in_time(tokenizer):
    """Synthetic alignment heads attending to frame 25·k at text token k (0.5 s a token): the words
    start where their first token's attention is, within the clip's frames."""
    from triton_pipelines.pipelines.speech.words import find_alignment

    text = tokenizer.encode(" one two three four")
    positions = 4 + len(text) + 1  # prompt + <|notimestamps|>, text, <|endoftext|>
    weights = np.full((2, positions, 1500), 1e-6, np.float32)
    for k in range(len(text) + 1):  # the row before token k predicts it
        weights[:, 3 + k, 25 * k:25 * k + 25] = 1.0
    weights /= weights.sum(axis=-1, keepdims=True)
    timings = find_alignment(weights, text, int(3.0 * 16000), tokenizer.encoding.decode, tokenizer.eot, "en")
    assert [t.word for t in timings] == [" one", " two", " three", " four"]
    assert [t.start for t in timings] == pytest.approx([0.0, 0.5, 1.0, 1.5], abs=0.05)
    assert [t.end for t in timings] == pytest.approx([0.5, 1.0, 1.5, 2.0], abs=0.05)


def test_the_decoder_aligns_the_word_windows_in_one_more_call(tokenizer):
    """A window with WORDS_SLOT: after its <|endoftext|>, one call feeds its whole aligned sequence
    (prompt, <|notimestamps|>, text without timestamps, <|endoftext|>) and asks for the weights."""
    from triton_pipelines.pipelines.speech.words import AlignedTokens

    text, calls, aligned = 700, [], []

    def step(input_ids, past, cross, parameters):
        calls.append(input_ids.shape[1])
        script = [ts(tokenizer, 0.0), text, ts(tokenizer, 0.5), tokenizer.eot]
        present = np.zeros((len(input_ids), 2, 1, past.shape[3] + input_ids.shape[1], 1), np.float32)
        return one_hot([script[min(len(calls) - 1, 3)]] * len(input_ids)) * 20 - 100.0, present  # the rest unlikely

    def align(input_ids, past, cross, parameters):
        aligned.append(input_ids.tolist())
        return np.ones((len(input_ids), 3, input_ids.shape[1], 1500), np.float32)

    cross = {name: np.zeros((1, 1, 1, 1), np.float32) for name in cross_names(1)}
    prompts = np.array([tokenizer.prompt_row("en", timestamps="word")], dtype=np.int64)
    tokens = GreedyDecoder(tokenizer, VOCAB, step, align=align).decode(prompts, 10, cross, heads=1, head_dim=1)
    assert tokens == [[ts(tokenizer, 0.0), text, ts(tokenizer, 0.5)]] and isinstance(tokens[0], AlignedTokens)
    assert aligned == [[[*prompts[0, :3].tolist(), tokenizer.no_timestamps, text, tokenizer.eot]]]
    assert tokens[0].weights.shape == (3, 6, 1500)
