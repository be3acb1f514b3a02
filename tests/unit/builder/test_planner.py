"""The memory planner (``python -m repo_builder plan``): its verdicts and placements for a few
repositories and GPU sizes (its estimates against measured stubs: tests/server/test_planner_measured.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from repo_builder.planner.estimates import Instance
from repo_builder.planner.graph import graph_weights, live_peak
from repo_builder.planner.placement import place, reduced_counts, smallest_fleet
from repo_builder.planner.sizes import GiB, GPUS, parse_bytes

from tests.conftest import ensure_repository, image_classifier
from tests.support.lifecycle_helpers import copy_repository

def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "repo_builder", "plan", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def repositories(tmp_path_factory) -> dict[str, Path]:
    """The built repository and two slices of it (text only, vision only)."""
    built = ensure_repository()
    root = tmp_path_factory.mktemp("plan")
    text = ["text_encoder", "text_encoder_batch", "text_tokenizer", "text_embedding",
            "text_embedding_batch", "text_embedding_v2", "text_embedding_batch_v2"]
    classifier = image_classifier(built)
    vision = [classifier, f"{classifier}_batch", "image_preprocess", "classification_postprocess",
              "image_classification"]
    return {"full": built, "text": copy_repository(built, root / "text", text),
            "vision": copy_repository(built, root / "vision", vision)}


def gpu_plan(repository: Path, gpu: str, gpus: int = 1) -> tuple[bool, str]:
    done = plan_cli("--repository", str(repository), "--gpu", gpu, "--gpus", str(gpus),
                    "--sequence-length", "whisper_decoder.input_ids=4",
                    "--sequence-length", "whisper_decoder.past_self_kv=224", "--check")
    assert done.returncode in (0, 1), done.stderr
    return done.returncode == 0, done.stdout


@pytest.mark.slow
def test_verdicts_for_repositories_and_gpu_sizes(repositories):
    verdicts = {(name, gpu): gpu_plan(path, gpu)[0] for name, path in repositories.items()
                for gpu in ("T4", "A100-40GB", "H200")}
    print(json.dumps({f"{n} on {g}": v for (n, g), v in verdicts.items()}, indent=1))
    for name in repositories:  # a larger GPU never turns a fit into a misfit
        sizes = [verdicts[(name, gpu)] for gpu in ("T4", "A100-40GB", "H200")]
        assert sizes == sorted(sizes), (name, sizes)
    assert verdicts[("vision", "T4")] and verdicts[("full", "H200")]
    assert not verdicts[("full", "T4")] and not verdicts[("text", "T4")]


@pytest.mark.slow
def test_a_misfit_gets_a_placement_over_more_gpus_that_fits(repositories):
    fits, report = gpu_plan(repositories["full"], "A100-40GB")
    assert not fits and "fits on" in report, report
    needed = int(report.split("fits on ")[1].split(" GPUs")[0])
    fits_there, placed = gpu_plan(repositories["full"], "A100-40GB", needed)
    assert fits_there, placed
    lines = [line.removeprefix("[plan]").strip() for line in report.splitlines()]
    groups = {line.split(":", 1)[0]: line.split(":", 1)[1] for line in lines if "instance_group" in line}
    classifier = image_classifier(repositories["full"])
    assert set(groups) == {classifier, f"{classifier}_batch", "text_encoder", "text_encoder_batch", "whisper_encoder",
                           "whisper_decoder"}
    for model, group in groups.items():  # every suggestion is a valid config fragment on a real GPU index
        config = text_format.Parse(group, mc.ModelConfig())
        assert all(g.kind == mc.ModelInstanceGroup.KIND_GPU and 0 <= g.gpus[0] < needed for g in config.instance_group)


@pytest.mark.slow
def test_the_host_check_make_serve_runs():
    done = plan_cli("--check")
    assert done.returncode == 0 and "[plan] FITS" in done.stdout, done.stdout + done.stderr
    tight = plan_cli("--check", "--host-memory", "1GiB")
    assert tight.returncode == 1 and "DOES NOT FIT" in tight.stdout


def unit(model: str, count: int, weights_gib: float, activations_gib: float) -> Instance:
    return Instance(model, 1, count, "gpu", "onnxruntime", weights=int(weights_gib * GiB),
                    activations=int(activations_gib * GiB), overhead=0)


def test_placement_respects_the_85_10_5_budget():
    memory = 10 * GiB  # models <= 8.5 GiB, batching <= 1 GiB, runtime <= 0.5 GiB
    assert place([unit("a", 1, 8.0, 0.9)], memory, 1).fits
    assert not place([unit("a", 1, 8.6, 0.1)], memory, 1).fits  # weights past 85%
    assert not place([unit("a", 1, 1.0, 1.1)], memory, 1).fits  # activations past 10%
    two = [unit("a", 2, 5.0, 0.3), unit("b", 1, 3.0, 0.6)]
    assert not place(two, memory, 1).fits
    plan = place(two, memory, 2)
    assert plan.fits and sorted(plan.placement["a"]) == [0, 1]
    assert smallest_fleet(two, memory) == 2
    assert reduced_counts(two, memory, 1) == {"a": 1}  # one instance of a fewer fits on one GPU
    assert reduced_counts([unit("a", 1, 9.0, 0.1)], memory, 1) is None


def test_sizes_and_graph_arithmetic():
    assert parse_bytes("40GiB") == 40 * GiB and parse_bytes("24GB") == 24 * 10**9 and GPUS["A100-40GB"] == 40
    from onnx import TensorProto, helper

    weight = helper.make_tensor("w", TensorProto.FLOAT, [4, 8], np.zeros(32, np.float32))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    weights = graph_weights(model)
    assert (weights.initializer_bytes, weights.gemm_weight_bytes, weights.fp32_bytes) == (128, 128, 128)
    peak, outputs = live_peak(model, {"x": [10, 4]})
    assert peak == 2 * 10 * 8 * 4 and outputs == 10 * 8 * 4  # h and y live together at the Relu
