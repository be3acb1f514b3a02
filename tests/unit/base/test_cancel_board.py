"""The cancel board (cancel_board.py): marks by id, nothing but our ids touches the filesystem,
old marks are swept and the count is bounded; the speech loop's ``client_gone`` reads it."""

from __future__ import annotations

import os
import time

from triton_pipelines import cancel_board
from triton_pipelines.cancel_board import BOARD_ENV, KEEP_S, CancelBoard, new_id
from triton_pipelines.limits import CLIENT_CANCEL_PARAMETER
from triton_pipelines.pipelines.speech.jobs import client_gone


def test_a_marked_id_is_seen_and_only_our_ids_are_paths(tmp_path):
    board = CancelBoard(tmp_path / "cancel").create()
    request_id, other = new_id(), new_id()
    assert len(request_id) == 32 and request_id != other
    assert board.mark(request_id) and board.marked(request_id) and not board.marked(other)
    for hostile in ("../../etc/passwd", "", None, 7, request_id.upper(), request_id + "0", "/" + request_id[1:]):
        assert not board.mark(hostile) and not board.marked(hostile)
    assert os.listdir(board.folder) == [request_id]


def test_create_empties_an_earlier_runs_marks_and_is_private(tmp_path):
    board = CancelBoard(tmp_path / "cancel").create()
    board.mark(new_id())
    assert not os.listdir(CancelBoard(tmp_path / "cancel").create().folder)
    assert (board.folder.stat().st_mode & 0o777) == 0o700


def test_old_marks_are_swept_and_the_count_is_bounded(tmp_path, monkeypatch):
    now = [time.time()]
    board = CancelBoard(tmp_path / "cancel", clock=lambda: now[0]).create()
    old = new_id()
    board.mark(old)
    os.utime(board.folder / old, (now[0] - KEEP_S - 1, now[0] - KEEP_S - 1))
    now[0] += 2
    board.mark(new_id())
    assert not board.marked(old) and len(os.listdir(board.folder)) == 1
    monkeypatch.setattr(cancel_board, "MAX_MARKS", 2)
    assert board.mark(new_id()) and not board.mark(new_id())
    assert len(os.listdir(board.folder)) == 2


def test_the_board_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(BOARD_ENV, raising=False)
    assert CancelBoard.from_environment() is None
    monkeypatch.setenv(BOARD_ENV, str(tmp_path))
    assert CancelBoard.from_environment().folder == tmp_path


def test_the_speech_loop_sees_a_marked_request_without_asking_triton(tmp_path):
    board = CancelBoard(tmp_path / "cancel").create()
    request_id = new_id()
    asked = []
    gone = client_gone({CLIENT_CANCEL_PARAMETER: request_id}, lambda: asked.append(1) or False, board=board)
    assert not gone() and asked == [1]
    board.mark(request_id)
    assert gone() and asked == [1]
    # without a board, or without an id, only Triton's own cancellation counts
    assert not client_gone({CLIENT_CANCEL_PARAMETER: request_id}, lambda: False)()
    assert not client_gone({}, lambda: False, board=board)()
