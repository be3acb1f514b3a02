"""Sizes: units, the tutorial's GPU budget, known GPUs, and the per-process constants the planner
estimates with (measured on the embedded target, or stated assumptions for the GPU)."""

from __future__ import annotations

import argparse
import re

from triton_pipelines.repository.contract import PYTHON_SHM_DEFAULT_BYTES, PYTHON_SHM_GROWTH_BYTES


MiB = 1 << 20
GiB = 1 << 30
# The tutorial's split of a GPU's memory.
BUDGET = {"models": 0.85, "batching": 0.10, "runtime": 0.05}
GPUS = {"T4": 16, "V100-16GB": 16, "V100-32GB": 32, "A10": 24, "A10G": 24, "L4": 24, "L40S": 48,
        "A100-40GB": 40, "A100-80GB": 80, "H100-80GB": 80, "H200": 141}

# Measured on the embedded target (tritonserver 2.51, Python 3.11, ONNX Runtime 1.32): the RSS of a
# Python-backend stub with numpy and triton_pipelines imported (37-44 MiB for our plain Python
# models), the same stub running ONNX Runtime on a one-node graph (77 MiB), tritonserver itself.
PYTHON_STUB_BYTES = 40 * MiB
ORT_STUB_BYTES = 77 * MiB
SERVER_PROCESS_BYTES = 44 * MiB
# ONNX Runtime's CPU arena over the graph's live peak (BFC arena, regions doubling): 0.9 to 2.0x on
# our models and shapes; 1.25 keeps every measured case within 25% (tests/unit/builder/test_planner.py).
CPU_ARENA_FACTOR = 1.25
# GPU constants: assumptions stated in docs/operations.md, not measured here.
CUDA_CONTEXT_BYTES = 512 * MiB  # per GPU: tritonserver's CUDA context with the backends' kernels
GPU_INSTANCE_BYTES = 128 * MiB  # per ONNX Runtime CUDA session: cuBLAS/cuDNN handles, workspaces
GPU_ARENA_FACTOR = 2.0  # ONNX Runtime's CUDA arena, kNextPowerOfTwo (the onnxruntime backend default)
TRT_ARENA_FACTOR = 1.0  # TensorRT sizes its execution context's memory exactly
# The Python-backend shared memory the launcher gives tritonserver (triton_pipelines.repository.contract).
SHM_DEFAULT_BYTES = PYTHON_SHM_DEFAULT_BYTES
SHM_GROWTH_BYTES = PYTHON_SHM_GROWTH_BYTES


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*(B|KB|KiB|MB|MiB|GB|GiB|TB|TiB)?\s*", text, re.I)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 40GiB, 24GB, 512MiB)")
    units = {"b": 1, "kb": 1e3, "kib": 1 << 10, "mb": 1e6, "mib": MiB, "gb": 1e9, "gib": GiB, "tb": 1e12,
             "tib": 1 << 40}
    return int(float(match[1]) * units[(match[2] or "b").lower()])


def gib(value: float) -> str:
    return f"{value / GiB:.2f}"
