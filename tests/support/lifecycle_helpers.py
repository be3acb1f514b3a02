"""Shared helpers of the lifecycle tests: a private copy of the built repository (a server of a
test module's own may change versions, pins, files and the split without touching the session
server's), and continuous traffic that records every answer."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor

TEXTS = ["I want a refund for my order", "my password does not work anymore", "hi",
         "where is my parcel? it was due yesterday", "cancel my subscription please",
         "the app crashes when I open settings"]


def link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


def copy_repository(source: Path, target: Path, models: list[str]) -> Path:
    """``models`` of ``source`` (and its ``.built``) in ``target``: files hard-linked where the file
    system allows (a file replaced by rename in the copy leaves the original alone), symlinks kept."""
    target.mkdir(parents=True)
    for name in models:
        shutil.copytree(source / name, target / name, symlinks=True, copy_function=link_or_copy,
                        ignore=shutil.ignore_patterns("splits.json"))
    shutil.copy2(source / ".built", target / ".built")
    return target


@dataclass
class Answer:
    kind: str  # "direct" or "router"
    target: str  # ensemble or task
    protocol: str
    text: int
    sent: float
    done: float
    output: np.ndarray | None = None  # embedding, or [score] for text_classification
    label: str | None = None  # text_classification's label
    version: int | None = None  # the router's model_version
    error: str = ""


class Traffic:
    """Closed-loop clients, each sending one request after the other until ``stop()``."""

    def __init__(self, server, workers: list[tuple[str, str, str]]):
        """``workers``: (kind, target, protocol) per client thread."""
        self.server = server
        self.workers = workers
        self.answers: list[Answer] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(w, i), daemon=True) for i, w in enumerate(workers)]

    def __enter__(self) -> "Traffic":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self, worker: tuple[str, str, str], index: int) -> None:
        kind, target, protocol = worker
        client = TritonClient(protocol, self.server.url(protocol))
        for count in itertools.count(index):
            if self._stop.is_set():
                break
            text = count % len(TEXTS)
            answer = Answer(kind, target, protocol, text, time.monotonic(), 0.0)
            try:
                if kind == "direct":
                    outputs = client.infer(target, {"text": text_tensor([TEXTS[text]])})
                    if "embedding" in outputs:
                        answer.output = outputs["embedding"][0]
                    else:
                        answer.output, answer.label = outputs["score"][0], outputs["label"][0, 0].decode()
                else:
                    payload = json.dumps({"text": TEXTS[text]})
                    result = json.loads(client.infer("router", {"task": text_tensor([target]),
                                                                "payload": text_tensor([payload])})["result"][0, 0])
                    answer.output = np.asarray(result["output"]["embedding"], np.float32)
                    answer.version = int(result["model_version"])
            except InferenceServerException as error:
                answer.error = str(error)
            answer.done = time.monotonic()
            with self.lock:
                self.answers.append(answer)
        client.close()

    def errors(self) -> list[Answer]:
        with self.lock:
            return [a for a in self.answers if a.error]

    def between(self, start: float, end: float) -> list[Answer]:
        """Answers to requests sent and answered within [start, end]."""
        with self.lock:
            return [a for a in self.answers if a.sent >= start and a.done <= end]
