"""stub.heap: a stub whose models allocate large arrays per request keeps freed memory on its heap
(config parameter ``heap_keep_freed_bytes``), so the next request reuses pages that are already
there instead of faulting in fresh ones (docs/speech.md: ~1 s per 150 MB on a VM)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from repo_builder.compute import ComputeModel, TensorSpec
from repo_builder.files import read_config
from repo_builder.speech_pipeline import HEAP_KEEP_FREED_BYTES
from triton_pipelines.stub.heap import HEAP_KEEP_PARAMETER, keep_freed_heap

from tests.conftest import ensure_repository

# A 64 MB array is over glibc's largest mmap threshold (32 MB): by default it is unmapped when freed.
PROBE = textwrap.dedent("""
    import sys
    import numpy as np
    from triton_pipelines.stub.heap import keep_freed_heap

    def resident_mb():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096 / 2**20

    print(keep_freed_heap({"heap_keep_freed_bytes": sys.argv[1]}))
    before = resident_mb()
    block = np.ones(64 * 2**20, np.uint8)
    del block
    print(round(resident_mb() - before))
""")


def run_probe(keep: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, keep], capture_output=True, text=True, check=True).stdout.split()
    return out[0], int(out[1])


def test_with_the_parameter_a_freed_block_stays_resident_for_the_next_request():
    kept, still_resident_mb = run_probe(str(256 * 2**20))
    assert kept == str(256 * 2**20)
    assert still_resident_mb >= 60


def test_without_it_glibc_gives_the_block_back():
    kept, still_resident_mb = run_probe("0")
    assert kept == "None"
    assert still_resident_mb < 10


def test_absent_or_zero_changes_nothing():
    assert keep_freed_heap({}) is None
    assert keep_freed_heap({HEAP_KEEP_PARAMETER: "0"}) is None
    with pytest.raises(ValueError):
        keep_freed_heap({HEAP_KEEP_PARAMETER: "lots"})
    with pytest.raises(ValueError, match="over"):
        keep_freed_heap({HEAP_KEEP_PARAMETER: str(2**31)})


def test_the_builder_writes_it_on_the_embedded_target_only():
    model = ComputeModel(name="m", inputs=(TensorSpec("x", "TYPE_FP32", (4,)),),
                         outputs=(TensorSpec("y", "TYPE_FP32", (4,)),), max_batch_size=4,
                         export_onnx=lambda path: None, embedded_heap_keep_freed_bytes=HEAP_KEEP_FREED_BYTES)
    assert model.config("embedded").parameters[HEAP_KEEP_PARAMETER].string_value == str(HEAP_KEEP_FREED_BYTES)
    assert HEAP_KEEP_PARAMETER not in model.config("gpu").parameters


def test_the_served_whisper_stubs_carry_it():
    repository = ensure_repository()
    for name in ("whisper_encoder", "whisper_decoder", "whisper_decode", "whisper_decode_batch",
                 "speech_recognition_stream"):
        parameters = read_config(repository / name / "config.pbtxt").parameters
        assert parameters[HEAP_KEEP_PARAMETER].string_value == str(HEAP_KEEP_FREED_BYTES)
    assert HEAP_KEEP_PARAMETER not in read_config(repository / "text_encoder" / "config.pbtxt").parameters
