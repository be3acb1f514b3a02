"""Fail loudly unless ONNX Runtime really runs on the GPU (benchmarks/gpu.sh runs this first).

`onnxruntime.get_available_providers()` lists what the wheel was built with, not what loads:
onnxruntime-gpu 1.31 is a CUDA 13 build, which needs an NVIDIA driver >= 580; on a 550-575 driver
the CUDA provider fails to load, ONNX Runtime logs it and falls back to the CPU, and the benchmark
would silently measure the CPU. So: create a real session asking for CUDA only and check that CUDA
is what it uses."""

from __future__ import annotations

import sys

DRIVER_NOTE = ("onnxruntime-gpu 1.31 (requirements-gpu.txt) is built for CUDA 13 and needs an NVIDIA driver "
               ">= 580 (nvidia-smi shows it); with an older driver its CUDA provider does not load")


def tiny_model() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def verify_cuda_provider(ort, model: bytes | None = None) -> str:
    """The provider a real session uses; raises RuntimeError unless it is CUDA."""
    import numpy as np

    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise RuntimeError(f"onnxruntime {ort.__version__} has no CUDA provider ({available}): is "
                           f"onnxruntime-gpu installed instead of onnxruntime? {DRIVER_NOTE}")
    session = ort.InferenceSession(model or tiny_model(), providers=["CUDAExecutionProvider"])
    used = session.get_providers()
    if not used or used[0] != "CUDAExecutionProvider":
        raise RuntimeError(f"onnxruntime {ort.__version__} lists CUDA but a session fell back to {used}: "
                           f"{DRIVER_NOTE}")
    session.run(None, {"x": np.ones(1, dtype=np.float32)})
    return used[0]


def main() -> int:
    import onnxruntime as ort

    try:
        provider = verify_cuda_provider(ort)
    except RuntimeError as error:
        print(f"[gpu] {error}", file=sys.stderr)
        return 1
    print(f"[gpu] onnxruntime {ort.__version__}: a session runs on {provider}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
