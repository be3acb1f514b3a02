"""The rollout command on a server of this module's own (the text pipelines and the router on a
private copy of the repository), under continuous load from HTTP and gRPC clients, both direct
ensemble callers and router callers:

- a full rollout 1 → 2 in steps and a rollback 2 → 1 fail no request, every answer is exactly
  version 1's or version 2's (no answer from a half-loaded model), the router's version label is
  the version that answered, and direct callers are on the new version once the command returns;
- a gate past its threshold rolls the rollout back by itself, still without a failed request;
- new files for the serving version are put in place and reloaded without a failed request, the
  latency-class variant (symlinked files) included.
The logic without a server (metrics parsing, the gate, the family): tests/unit/ops/test_rollout.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from triton_pipelines.client import TritonClient, text_tensor
from triton_pipelines.ops.rollout import Breach, Gate, Metrics, Rollout
from triton_pipelines.server.launcher import start_on_free_ports

from tests.conftest import LOG_DIR, ensure_repository
from tests.support.lifecycle_helpers import TEXTS, Traffic, copy_repository

MODELS = ["router", "text_tokenizer", "text_encoder", "text_encoder_batch", "intent_classifier",
          "text_embedding", "text_embedding_v2", "text_embedding_batch", "text_embedding_batch_v2",
          "text_classification", "text_classification_v2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = copy_repository(ensure_repository(), tmp_path_factory.mktemp("lifecycle") / "repository", MODELS)
    saved = os.environ.pop("ROUTER_SPLIT_FILE", None)  # the router must read the copy's split file
    try:
        launched = start_on_free_ports(repository, LOG_DIR / "test-rollout-server.log", models=MODELS)
    finally:
        if saved is not None:
            os.environ["ROUTER_SPLIT_FILE"] = saved
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def rollout(server):
    return Rollout(server.control, server.metrics_url, Path(server.options.model_repository), "text_encoder",
                   log=lambda message: print(f"[rollout {time.strftime('%H:%M:%S')}] {message}"), poll_s=0.25, quiet_s=1.0)


WORKERS = [("direct", "text_embedding", "grpc"), ("direct", "text_embedding", "http"),
           ("direct", "text_embedding_batch", "grpc"), ("direct", "text_classification", "http"),
           ("router", "text_embedding", "grpc"), ("router", "text_embedding", "http")]


V1_TOLERANCE = 1e-4


V2_TOLERANCE = 0.1


@pytest.fixture(scope="module")
def references(server) -> dict[int, dict[int, np.ndarray]]:
    """version → text → embedding, and for text_classification version → text → (label, score),
    from the pinned ensembles before anything changes."""
    client = TritonClient("grpc", server.grpc_url)
    refs = {"embedding": {}, "classification": {}}
    for version, suffix in ((1, ""), (2, "_v2")):
        refs["embedding"][version] = {i: client.infer(f"text_embedding{suffix}", {"text": text_tensor([t])})["embedding"][0]
                                      for i, t in enumerate(TEXTS)}
        refs["classification"][version] = {}
        for i, t in enumerate(TEXTS):
            out = client.infer(f"text_classification{suffix}", {"text": text_tensor([t])})
            refs["classification"][version][i] = (out["label"][0, 0].decode(), out["score"][0])
    client.close()
    return refs


def served_by(answer, refs) -> int:
    """Which version answered. Version 1 (fp32) answers its reference to float noise whatever the
    batch; version 2's dynamic int8 quantization scales activations per batch, so its answers
    move with what they were batched with (~0.02): near its reference, never version 1's. An
    answer from a half-loaded or wrong model is neither."""
    if answer.label is not None:  # text_classification: a label either version gives
        assert answer.label in {refs["classification"][v][answer.text][0] for v in (1, 2)}, answer
        return 0
    one, two = refs["embedding"][1][answer.text], refs["embedding"][2][answer.text]
    if np.abs(answer.output - one).max() < V1_TOLERANCE:
        return 1
    assert np.abs(answer.output - two).max() < V2_TOLERANCE, (
        f"an answer that is neither version's: {np.abs(answer.output - one).max()} from version 1, "
        f"{np.abs(answer.output - two).max()} from version 2 ({answer})")
    return 2


def test_version_2_differs_from_version_1(references):
    """The checks below can tell the versions apart."""
    for i in range(len(TEXTS)):
        assert np.abs(references["embedding"][1][i] - references["embedding"][2][i]).max() > 10 * V1_TOLERANCE


def test_a_gate_past_its_threshold_rolls_back_by_itself(server, rollout):
    """From the built canary state (both versions loaded, the router's default 90/10 split)."""
    assert rollout.loaded_versions() == {1, 2} and rollout.current_version() == 1
    gate = Gate(max_p99_ms=0.001, min_requests=1)  # no version can pass: the first step breaches
    with Traffic(server, WORKERS[:2] + WORKERS[4:]) as traffic:
        with pytest.raises(Breach) as breach:
            rollout.move(2, steps=(10, 50, 100), hold_s=3.0, gate=gate)
        time.sleep(0.5)
    assert breach.value.rolled_back and "p99" in str(breach.value)
    assert [r.share for r in breach.value.steps] == [10]
    assert rollout.loaded_versions() == {1} and rollout.current_version() == 1 and rollout.split() == {1: 100}
    assert not traffic.errors(), traffic.errors()[:5]


def test_rollout_and_rollback_under_load_fail_nothing(server, rollout, references):
    assert rollout.loaded_versions() == {1} and rollout.current_version() == 1  # the gate's rollback left that
    marks = {}
    with Traffic(server, WORKERS) as traffic:
        time.sleep(1.0)
        marks["start"] = time.monotonic()
        reports = rollout.move(2, steps=(10, 50, 100), hold_s=1.5, gate=Gate(max_failure_ratio=0.0))
        marks["rolled_out"] = time.monotonic()
        assert rollout.loaded_versions() == {2} and rollout.current_version() == 2
        time.sleep(1.5)
        marks["rollback"] = time.monotonic()
        rollout.move(1, steps=(100,), hold_s=0)
        marks["rolled_back"] = time.monotonic()
        assert rollout.loaded_versions() == {1} and rollout.current_version() == 1
        time.sleep(1.5)
        marks["end"] = time.monotonic()
    assert [r.share for r in reports] == [10, 50, 100] and not any(r.breach for r in reports)
    assert not traffic.errors(), traffic.errors()[:5]
    phases = list(marks.items())
    for (name, start), (_, end) in zip(phases, phases[1:]):
        answered = traffic.between(start, end)
        assert len(answered) >= 3, f"too little traffic during {name}: {len(answered)}"
    for answer in traffic.answers:
        version = served_by(answer, references)  # every answer is one version's
        if not version:
            continue
        if answer.kind == "router":
            assert answer.version == version, answer  # the label is the version that answered
        if answer.sent >= marks["rolled_out"] and answer.done <= marks["rollback"]:
            assert version == 2, answer  # once rolled out, everyone is on version 2
        if answer.sent >= marks["rolled_back"] or answer.done <= marks["start"]:
            assert version == 1, answer
    router_versions = {a.version for a in traffic.between(marks["start"], marks["rolled_out"]) if a.kind == "router"}
    assert router_versions == {1, 2}  # the split moved the router's traffic over in steps
    metrics = Metrics.scrape(server.metrics_url)
    assert metrics.total("launcher_stub_restarts_total") == 0  # reloads are not mistaken for dead stubs


def test_new_files_for_the_serving_version_are_swapped_in_without_failures(server, rollout, references, tmp_path):
    """Version 1's model.onnx is replaced (here by the int8 weights of version 2, so the answers
    show which file served them) while it serves; text_encoder_batch's symlinks follow."""
    assert rollout.loaded_versions() == {1}
    repository = Path(server.options.model_repository)
    new = tmp_path / "new"
    new.mkdir()
    os.link(repository / "text_encoder" / "2" / "model.onnx", new / "model.onnx")
    with Traffic(server, WORKERS[:4]) as traffic:
        time.sleep(1.0)
        rollout.replace_files(1, new)
        replaced = time.monotonic()
        time.sleep(2.0)
    assert not traffic.errors(), traffic.errors()[:5]
    after = [a for a in traffic.answers if a.sent >= replaced]
    assert {a.target for a in after} == {"text_embedding", "text_embedding_batch", "text_classification"}
    for answer in traffic.answers:
        version = served_by(answer, references)  # the old file's answer or the new file's, nothing else
        if answer.sent >= replaced and version:
            assert version == 2, answer  # "2": the new file's weights, served as version 1
