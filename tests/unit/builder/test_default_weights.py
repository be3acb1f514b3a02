"""No default build serves random weights (issue 32): on a machine with no hub (HF_HUB_OFFLINE and
an empty cache), every compute model of the embedded and gpu targets' default builds has real
weights with their provenance, and the repository `make repository` built says so in `.built`."""

from __future__ import annotations

import pytest

from repo_builder.__main__ import parse_context
from repo_builder.repository import compute_models_of
from triton_pipelines.repository.contract import BuiltManifest

from tests.conftest import ensure_repository


@pytest.mark.parametrize("target", ["embedded", "gpu"])
def test_every_compute_model_of_a_default_build_is_real_without_a_hub(target, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))
    context, pipelines = parse_context(["--target", target, "--output", str(tmp_path / "repository")])
    models = compute_models_of(context, pipelines)
    assert {m.name for m in models} >= {"text_encoder", "efficientnet_lite0", "whisper_encoder", "whisper_decoder"}
    for model in models:
        assert model.provenance is not None, model.name
        assert not model.provenance.random and model.provenance.kind == "package", (model.name, model.provenance)
        assert model.provenance.files and all(len(sha) == 64 for _, sha in model.provenance.files), model.name
        parameters = model.config(target).parameters
        assert "random_weights" not in parameters and parameters["weights_kind"].string_value == "package"


def test_the_built_default_repository_has_no_random_row():
    built = BuiltManifest.read(ensure_repository())
    compute_rows = [row for row in built.model_table if "kind" in row]
    assert {row["model"] for row in compute_rows} >= {"text_encoder", "efficientnet_lite0", "whisper_encoder", "whisper_decoder"}
    assert not any(row.get("random") or "random" in row["weights"].lower() for row in built.model_table), built.model_table
