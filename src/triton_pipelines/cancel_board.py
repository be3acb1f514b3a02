"""Requests whose client has gone, as the request screen saw it, for the models that would otherwise
work on for nobody: a folder of empty marker files, one per such request, shared by a replica's
screen (which writes them) and its tritonserver's Python stubs (which look).

Why: Triton 2.51 answers a native HTTP request to the end whatever its client does (its HTTP API
has no cancellation), and it cancels an ensemble's step only when it schedules the step after the
cancellation, never a running one. A client could send 300 s of audio, hang up at once, and send
it again: nginx and the screen give its place back at the hang-up while ``whisper_decode`` decodes
every window, so one client's work would be unbounded. The screen gives every inference request an
id (``limits.CLIENT_CANCEL_PARAMETER``, a header Triton forwards to the models as a request
parameter; a client cannot send it), and marks the id here when the client leaves before the
answer (HTTP: nginx closes the connection; gRPC: the call is cancelled). ``whisper_decode``'s loop
asks ``marked(id)`` between steps (``speech.jobs.client_gone``: one ``stat`` every 0.1 s per
request) and stops.

Bounded: an id is 32 hex digits (anything else is never a path), a mark is an empty file, marks
older than ``KEEP_S`` are swept at the next mark, and at most ``MAX_MARKS`` are kept."""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

from triton_pipelines.limits import REQUEST_TIMEOUT_S

# The folder, in the environment of the screen and of tritonserver (and so of its stubs).
BOARD_ENV = "TRITON_PIPELINES_CANCEL_BOARD"
# A mark outlives the longest legal request, then goes.
KEEP_S = 2 * REQUEST_TIMEOUT_S
MAX_MARKS = 10_000
_ID = re.compile(r"[0-9a-f]{32}")


def new_id() -> str:
    return secrets.token_hex(16)


class CancelBoard:
    def __init__(self, folder: Path | str, clock=time.time):
        self.folder = Path(folder)
        self.clock = clock
        self._swept = 0.0

    @classmethod
    def from_environment(cls) -> "CancelBoard | None":
        folder = os.environ.get(BOARD_ENV)
        return cls(folder) if folder else None

    def create(self) -> "CancelBoard":
        """The folder, made (only its owner may write there) and emptied of an earlier run's marks."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for mark in self.folder.iterdir():
            mark.unlink(missing_ok=True)
        return self

    def mark(self, request_id: str | None) -> bool:
        """The client of ``request_id`` has gone; False for an id that is not one of ours, or a full board."""
        if not isinstance(request_id, str) or not _ID.fullmatch(request_id):
            return False
        self._sweep()
        try:
            if len(os.listdir(self.folder)) >= MAX_MARKS:
                return False
            (self.folder / request_id).touch()
        except OSError:
            return False
        return True

    def marked(self, request_id) -> bool:
        if not isinstance(request_id, str) or not _ID.fullmatch(request_id):
            return False
        return (self.folder / request_id).exists()

    def _sweep(self) -> None:
        """Marks older than ``KEEP_S`` go (at most once a second)."""
        now = self.clock()
        if now - self._swept < 1.0:
            return
        self._swept = now
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return
        for entry in entries:
            try:
                if now - entry.stat().st_mtime > KEEP_S:
                    os.unlink(entry.path)
            except OSError:
                pass
