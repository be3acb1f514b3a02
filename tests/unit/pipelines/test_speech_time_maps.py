"""Timed transcripts of VAD-packed windows: audio_features' ``window_spans`` rows (window, start,
end) carry each window's time map to whisper_decode (``features.pad_time_maps`` →
``jobs.item_spans``), and segment and word times go through it, so a time in a window that holds
two stretches of the clip back to back lands in the clip where that stretch was."""

from __future__ import annotations

import numpy as np
import pytest

from triton_pipelines.errors import InputError
from triton_pipelines.pipelines.speech.features import pad_time_maps
from triton_pipelines.pipelines.speech.jobs import item_spans
from triton_pipelines.pipelines.speech.timestamps import window_segments
from triton_pipelines.pipelines.speech.vad import TimeMap

SR = 16000
BEGIN = 50364  # <|0.00|> of the multilingual vocabulary


def test_the_rows_carry_every_window_map_and_padding_rows_are_ignored():
    first = [TimeMap([(0, 2 * SR), (10 * SR, 14 * SR)]), TimeMap([(20 * SR, 21 * SR)])]
    second = [TimeMap([(5 * SR, 6 * SR)])]
    rows = pad_time_maps([first, second])
    assert rows.shape == (2, 3, 3) and rows[1, 1:, 0].tolist() == [-1, -1]
    maps = item_spans(rows, [2, 1])
    assert [m.spans for m in maps[0]] == [t.spans for t in first] and maps[1][0].spans == second[0].spans
    assert [m.spans for m in item_spans(None, [2])[0]] == [[(0, 30 * SR)], [(30 * SR, 60 * SR)]]
    with pytest.raises(InputError, match="maps 1 of its 2 windows"):
        item_spans(pad_time_maps([first[:1]]), [2])


def test_segment_times_of_a_packed_window_land_where_each_stretch_was_in_the_clip():
    # the window holds 0-2 s and 10-14 s of the clip back to back: its 3.0 s is the clip's 11.0 s
    window = TimeMap([(0, 2 * SR), (10 * SR, 14 * SR)])
    stamp = lambda seconds: BEGIN + int(round(seconds / 0.02))  # noqa: E731
    tokens = [stamp(0.0), 7, stamp(1.5), stamp(2.5), 8, stamp(3.0)]
    segments = window_segments(tokens, window, BEGIN, lambda ids: " ".join(map(str, ids)))
    assert [(s.start, s.end, s.text) for s in segments] == [(0.0, 1.5, "7"), (10.5, 11.0, "8")]
    # a time at the join: an end stays in the earlier stretch, a start goes to the later one
    assert window.original_time(2.0, is_end=True) == 2.0 and window.original_time(2.0) == 10.0
    assert np.isclose(window.duration, 6.0)
