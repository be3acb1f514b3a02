"""Warm-up without a server: every compute model's generated config has a warm-up sample for each
input (the warm-up on a server: tests/server/test_warmup.py)."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from repo_builder.__main__ import parse_context
from repo_builder.compute import TARGETS


@pytest.mark.parametrize("target", TARGETS)
def test_every_compute_model_has_a_warmup_sample_for_each_input(target):
    context, pipelines = parse_context(["--target", target])
    for model in [m for pipeline in pipelines for m in pipeline.compute_models(context)]:
        config = text_format.Parse(text_format.MessageToString(model.config(target)), mc.ModelConfig())
        assert config.model_warmup, model.name
        for sample in config.model_warmup:
            assert 1 <= sample.batch_size <= config.max_batch_size
            assert set(sample.inputs) == {t.name for t in config.input}, model.name
            for tensor in config.input:
                data = sample.inputs[tensor.name]
                assert data.zero_data and data.data_type == tensor.data_type
                assert len(data.dims) == len(tensor.dims) and all(d > 0 for d in data.dims)
