"""The contract between the builder and the runtime (triton_pipelines/repository/contract.py), without a server:
variant names both ways, the build stamp read and written back byte for byte, and the Python
backend's shared-memory sizes the launcher and the planner share."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from triton_pipelines.repository.contract import (LATENCY_CLASSES, PYTHON_BACKEND_SHM_CONFIG, PYTHON_SHM_DEFAULT_BYTES,
                                     PYTHON_SHM_GROWTH_BYTES, STABLE_VERSION, BuiltManifest, ComputeModelFacts,
                                     VariantName, parse_variant_name, variant_name)

from tests.conftest import ensure_repository


@pytest.mark.parametrize("base, latency_class, version, name", [
    ("text_embedding", None, None, "text_embedding"),
    ("text_embedding", "realtime", STABLE_VERSION, "text_embedding"),
    ("text_embedding", "batch", None, "text_embedding_batch"),
    ("text_embedding", "realtime", 2, "text_embedding_v2"),
    ("text_embedding", "batch", 2, "text_embedding_batch_v2"),
    ("text_encoder", "batch", None, "text_encoder_batch"),
])
def test_variant_names(base, latency_class, version, name):
    assert variant_name(base, latency_class, version) == name
    parsed = parse_variant_name(name)
    assert parsed == VariantName(base, latency_class or "realtime", None if version in (None, STABLE_VERSION) else version)
    assert parsed.unversioned == variant_name(base, latency_class)


def test_every_built_model_name_parses_back_to_itself():
    """Each folder of the built repository is ``variant_name`` of what ``parse_variant_name`` reads in it;
    every variant's base is a model of its own."""
    manifest = BuiltManifest.read(ensure_repository())
    for name in manifest.models:
        parsed = parse_variant_name(name)
        assert variant_name(*parsed) == name
        assert parsed.base in manifest.models
        assert parsed.latency_class in LATENCY_CLASSES
    for base, facts in manifest.compute_models.items():
        assert [parse_variant_name(v) for v in facts.latency_variants] == [VariantName(base, "batch", None)] * len(
            facts.latency_variants)


def test_the_stamp_reads_and_writes_back_byte_for_byte(tmp_path):
    repository = ensure_repository()
    manifest = BuiltManifest.read(repository)
    manifest.write(tmp_path)
    assert BuiltManifest.file(tmp_path).read_bytes() == BuiltManifest.file(repository).read_bytes()
    assert manifest.target in ("embedded", "gpu") and manifest.public_models and manifest.shm_bytes
    assert all(isinstance(f, ComputeModelFacts) for f in manifest.compute_models.values())


def test_an_older_stamp_reads_with_defaults(tmp_path):
    (tmp_path / ".built").write_text(json.dumps({"shm_bytes": 1}))
    manifest = BuiltManifest.read(tmp_path)
    assert (manifest.target, manifest.public_models, manifest.compute_models, manifest.shm_bytes) == (
        "embedded", None, {}, 1)
    assert not BuiltManifest.exists(tmp_path / "missing")


def test_the_launcher_and_the_planner_share_the_shm_sizes():
    from repo_builder.planner import sizes
    from triton_pipelines.server import launcher

    assert launcher.PYTHON_BACKEND_CONFIG == PYTHON_BACKEND_SHM_CONFIG == (
        "shm-default-byte-size=16777216", "shm-growth-byte-size=16777216")
    assert (sizes.SHM_DEFAULT_BYTES, sizes.SHM_GROWTH_BYTES) == (PYTHON_SHM_DEFAULT_BYTES, PYTHON_SHM_GROWTH_BYTES)


def test_layout_imports_nothing_heavy():
    """The builder, the launcher and the router (inside Triton's stub) import it: standard library only."""
    code = ("import sys; before = set(sys.modules); import triton_pipelines.repository.contract; "
            "print(sorted(m.split('.')[0] for m in set(sys.modules) - before))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout.replace("'", '"'))
    assert set(loaded) <= {"triton_pipelines"} | set(sys.stdlib_module_names), loaded


# ------------------------------------------------------------------------------ weights provenance
def _stamp_with_rows():
    from triton_pipelines.repository.contract import BuiltManifest, Provenance

    real = Provenance(kind="hub", source="BAAI/bge-small-en-v1.5", revision="a" * 40, architecture="BERT bge",
                      licence="mit", parameters=33_400_000, files=(("model.safetensors", "b" * 64),))
    noise = Provenance(kind="random", source="seed 0", architecture="bert-base-uncased")
    rows = [dict(real.row("text_encoder"), served_by=["text_classification", "text_embedding"]),
            dict(noise.row("bert_base_encoder"), served_by=[]),
            {"model": "router", "architecture": "Python BLS router", "weights": "none (route file)"}]
    return BuiltManifest(model_table=rows), real


def test_the_model_table_rows_read_back_as_provenance_and_per_public_model():
    from triton_pipelines.repository.contract import Provenance

    stamp, real = _stamp_with_rows()
    assert Provenance.from_row(stamp.model_table[0]) == real
    assert Provenance.from_row(stamp.model_table[2]) is None
    (served,) = stamp.provenance_of("text_embedding")
    assert served["source"] == "BAAI/bge-small-en-v1.5" and served["revision"] == "a" * 40
    assert "served_by" not in served and stamp.provenance_of("image_classification") == []


def test_the_start_up_lines_name_the_weights_and_say_random_loudly():
    stamp, _ = _stamp_with_rows()
    real, noise, router = stamp.weights_log()
    assert real == ("model text_encoder: real: Hugging Face BAAI/bge-small-en-v1.5@" + "a" * 40
                    + " [BERT bge, licence mit, 33.4M parameters]")
    assert noise.startswith("WARNING: bert_base_encoder serves RANDOM WEIGHTS: model bert_base_encoder: RANDOM WEIGHTS")
    assert router == "model router: none (route file) [Python BLS router]"
