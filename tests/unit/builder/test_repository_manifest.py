"""The default embedded build (``make repository``) is the committed manifest, file for file: a
refactoring of the builder, of the sources or of the values the builder writes into the configs
(the model input limits, written from the Python modules' constants) leaves what Triton serves as
it was. No server. A deliberate change: ``.venv/bin/python -m tests.support.repository_manifest --write``
and read the diff of tests/data/repository_manifest.json."""

from __future__ import annotations

import hashlib
import json

import pytest

from triton_pipelines.repository.contract import BuiltManifest

from tests.conftest import ensure_repository
from tests.support.repository_manifest import MANIFEST, differences, manifest


def test_the_default_build_is_the_committed_manifest():
    repository = ensure_repository()
    expected = json.loads(MANIFEST.read_text())
    built = BuiltManifest.read(repository)
    chosen = any("local checkpoint" in str(row) or row.get("kind") in ("folder", "hub", "random")
                 for row in built.model_table)
    if built.target != "embedded" or chosen:
        pytest.skip("model_repository/ is not the default embedded build (make repository builds it)")
    assert differences(expected, manifest(repository)) == []


def test_the_manifest_hashes_text_names_weights_and_follows_no_link(tmp_path):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"')
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"\0weights")
    (tmp_path / "m_batch" / "1").mkdir(parents=True)
    (tmp_path / "m_batch" / "1" / "model.onnx").symlink_to("../../m/1/model.onnx")
    (tmp_path / "m" / "1" / "__pycache__").mkdir()
    (tmp_path / "m" / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"")
    found = manifest(tmp_path)
    assert found == {"m/1/model.onnx": "weights", "m/config.pbtxt": "sha256:" + hashlib.sha256(b'name: "m"').hexdigest(),
                     "m_batch/1/model.onnx": "-> ../../m/1/model.onnx"}
    assert differences(found, {**found, "m/config.pbtxt": "sha256:0", "n/config.pbtxt": "sha256:1"}) == [
        "new: n/config.pbtxt", "changed: m/config.pbtxt"]
