"""Canary splits: which version of a canary model serves a request (stable per key), and the
run-time split file that overrides the route file's default shares."""

from __future__ import annotations

import hashlib
import json
import random
import threading
from pathlib import Path
from typing import Mapping

from triton_pipelines.repository.routes import Canary, validate_split


def split_point(task: str, key: str | None) -> float:
    """A number in [0, 1): the same for the same (task, key), uniform over keys; random without one."""
    if not key:
        return random.random()
    digest = hashlib.sha256(f"{task}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def choose_version(split: Mapping[int, float], point: float) -> int:
    total = sum(split.values())
    cumulative = 0.0
    for version in sorted(split):
        cumulative += split[version] / total
        if point < cumulative and split[version] > 0:
            return version
    return max(v for v, s in split.items() if s > 0)


class SplitFile:
    """Run-time canary shares: a small JSON file re-read when its mtime or size changes.

    ``{"text_encoder": {"1": 50, "2": 50}}`` overrides the route file's default split of that
    canary. A missing file means the defaults; an invalid file keeps the last valid shares and is
    reported by ``error`` (the router logs it).
    """

    def __init__(self, path: Path | str | None, canaries: Mapping[str, Canary]):
        self.path = Path(path) if path else None
        self.canaries = canaries
        self._stamp: tuple[int, int] | None = None
        self._overrides: dict[str, dict[int, float]] = {}
        self.error = ""
        self._lock = threading.Lock()

    def _read(self) -> None:
        if self.path is None:
            return
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._stamp, self._overrides, self.error = None, {}, ""
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            document = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(document, dict):
                raise ValueError("the split file must be a JSON object: {canary model: {version: share}}")
            overrides = {}
            for model, split in document.items():
                if model not in self.canaries:
                    raise ValueError(f"unknown canary model {model!r}; known: {sorted(self.canaries)}")
                overrides[model] = validate_split(split, self.canaries[model].versions, f"{self.path}: {model}")
            self._overrides, self.error = overrides, ""
        except (ValueError, OSError) as error:
            self.error = f"{self.path}: {error}; keeping the previous split"

    def split(self, canary: str) -> dict[int, float]:
        with self._lock:
            self._read()
            return dict(self._overrides.get(canary) or self.canaries[canary].split)
