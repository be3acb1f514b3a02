"""The benchmark's logic without measuring anything: ratios against peers, the sweep grid, the config
search and its write-back into the builder's model description, the peers' micro-batcher and the
body framing the load generator and the peers share. No timing assertions."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from benchmarks.loadgen import bytes_tensor, split_bytes_tensor
from benchmarks.peers.batcher import MicroBatcher
from benchmarks.report import Point, SweepPoint, best_config, grid, instances_vs_batching, parse_budgets, versus


def point(system, concurrency, throughput, p95):
    return Point(system, concurrency, throughput, p95 / 2, p95 / 2, p95, p95 * 1.2)


def sweep(instances, batch, delay, throughput, p95, errors=0):
    return SweepPoint("m", instances, batch, delay, max(1, 2 // instances), throughput, p95, float(batch), errors)


def test_versus_needs_throughput_and_no_worse_p95():
    points = [point("Triton", 16, 120.0, 100.0), point("FastAPI", 16, 100.0, 110.0), point("Infinity", 16, 130.0, 90.0)]
    fastapi = versus(points, "Triton", "FastAPI", 16)
    assert fastapi.throughput_ratio == pytest.approx(1.2) and fastapi.meets(1.2)
    infinity = versus(points, "Triton", "Infinity", 16)
    assert not infinity.meets(1.0) and not infinity.p95_no_worse
    assert versus(points, "Triton", "FastAPI", 4) is None


def test_best_config_respects_the_budget_and_prefers_the_cheaper_tie():
    points = [sweep(1, 1, 0, 50, 300), sweep(1, 8, 0, 90, 180), sweep(4, 1, 0, 95, 400),
              sweep(2, 8, 0, 90, 150), sweep(1, 16, 0, 99, 240, errors=3)]
    assert best_config(points, 200) == points[1]  # 4x1 is faster but over budget; the errored one never counts
    assert best_config(points, 500) == points[2]
    assert best_config(points, 10) is None


def test_grid_places_values_and_leaves_gaps_nan():
    points = [sweep(1, 1, 0, 10, 1), sweep(1, 4, 0, 20, 1), sweep(4, 1, 0, 30, 1), sweep(1, 1, 2000, 99, 1)]
    instances, batches, values = grid(points, 0, "throughput")
    assert instances == [1, 4] and batches == [1, 4]
    assert values[0] == [10, 20] and values[1][0] == 30 and math.isnan(values[1][1])


def test_instances_vs_batching_picks_the_tutorial_pair():
    points = [sweep(4, 1, 0, 30, 1), sweep(1, 4, 0, 20, 1), sweep(1, 1, 0, 10, 1)]
    many, batched = instances_vs_batching(points)
    assert (many.instances, many.max_batch, batched.instances, batched.max_batch) == (4, 1, 1, 4)
    assert instances_vs_batching(points[2:]) is None


def test_parse_budgets():
    defaults = {"a": 1.0, "b": 2.0}
    assert parse_budgets("", defaults) == defaults
    assert parse_budgets("50", defaults) == {"a": 50.0, "b": 50.0}
    assert parse_budgets("b=7", defaults) == {"a": 1.0, "b": 7.0}
    with pytest.raises(ValueError, match="swept models"):
        parse_budgets("c=1", defaults)


def test_bytes_tensor_framing_round_trips():
    items = [b"", b"hello", "héllo".encode(), bytes(range(256))]
    assert split_bytes_tensor(bytes_tensor(items)) == items
    with pytest.raises(ValueError):
        split_bytes_tensor(bytes_tensor([b"abc"])[:-1])


def test_micro_batcher_batches_what_waits_and_keeps_order():
    seen = []

    def run(items):
        seen.append(list(items))
        return [item * 10 for item in items]

    async def main():
        batcher = MicroBatcher(run, max_items=3)
        await batcher.start()
        results = await asyncio.gather(*(batcher.submit(i) for i in range(7)))
        await batcher.stop()
        return results

    assert asyncio.run(main()) == [i * 10 for i in range(7)]
    assert [i for batch in seen for i in batch] == list(range(7))  # FIFO across batches
    assert all(len(batch) <= 3 for batch in seen) and len(seen) < 7  # requests that waited were batched


def test_micro_batcher_fails_only_the_failing_batch():
    def run(items):
        if "bad" in items:
            raise RuntimeError("boom")
        return items

    async def main():
        batcher = MicroBatcher(run, max_items=1)
        await batcher.start()
        outcomes = await asyncio.gather(batcher.submit("bad"), batcher.submit("good"), return_exceptions=True)
        await batcher.stop()
        return outcomes

    bad, good = asyncio.run(main())
    assert isinstance(bad, RuntimeError) and good == "good"


def test_tuning_file_changes_the_description_and_its_config(tmp_path: Path):
    from repo_builder.compute import ComputeModel, TensorSpec
    from repo_builder.tuning import TUNING_FILE, apply_tuning

    model = ComputeModel(name="enc", inputs=(TensorSpec("x", "TYPE_FP32", (4,)),),
                         outputs=(TensorSpec("y", "TYPE_FP32", (4,)),), max_batch_size=16, export_onnx=lambda p: None)
    assert apply_tuning(model, tmp_path) is model  # no file: the description as written
    (tmp_path / TUNING_FILE).parent.mkdir(parents=True)
    (tmp_path / TUNING_FILE).write_text(json.dumps({"enc": {
        "instances": 2, "intra_op_threads": 1, "preferred_batch_sizes": [8], "max_queue_delay_microseconds": 500,
        "measured": {"throughput": 1.0}}}))
    tuned = apply_tuning(model, tmp_path)
    config = tuned.config("embedded")
    assert config.instance_group[0].count == 2
    assert config.parameters["intra_op_threads"].string_value == "1"
    assert list(config.dynamic_batching.preferred_batch_size) == [8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert tuned.content_hash() == model.content_hash()  # batching never re-exports ONNX
    (tmp_path / TUNING_FILE).write_text(json.dumps({"enc": {"preferred_batch_sizes": [32]}}))
    with pytest.raises(ValueError, match="max_batch_size"):
        apply_tuning(model, tmp_path)
