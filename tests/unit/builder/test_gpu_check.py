"""benchmarks/gpu_check.py: a CUDA provider that is listed but does not load is caught (issue 20, item 9)."""

from __future__ import annotations

import pytest

from benchmarks.gpu_check import verify_cuda_provider


class FakeSession:
    def __init__(self, providers):
        self._providers = providers

    def get_providers(self):
        return self._providers

    def run(self, *_):
        return [None]


class FakeOrt:
    """onnxruntime-gpu built for CUDA 13 on a 550-575 driver: CUDA listed, sessions fall back to CPU."""
    __version__ = "1.31.1"

    def __init__(self, used):
        self.used = used

    def get_available_providers(self):
        return ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]

    def InferenceSession(self, model, providers):  # noqa: N802 - onnxruntime's name
        return FakeSession(self.used)


def test_a_listed_cuda_provider_that_falls_back_to_the_cpu_fails_loudly():
    with pytest.raises(RuntimeError, match="driver >= 580"):
        verify_cuda_provider(FakeOrt(["CPUExecutionProvider"]), model=b"")


def test_a_session_on_cuda_passes():
    assert verify_cuda_provider(FakeOrt(["CUDAExecutionProvider", "CPUExecutionProvider"]), model=b"") == "CUDAExecutionProvider"


def test_the_cpu_onnxruntime_here_is_refused():
    import onnxruntime

    with pytest.raises(RuntimeError):
        verify_cuda_provider(onnxruntime)
