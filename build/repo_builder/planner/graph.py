"""One ONNX graph: its weights at their stored precision (and the GEMM weights ONNX Runtime pre-packs
on the CPU) and its live activation peak at given input shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass


GEMM_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "MatMulInteger", "DynamicQuantizeMatMul",
            "MatMulIntegerToFloat", "QLinearConv", "QLinearMatMul", "ConvInteger", "FusedMatMul", "FusedConv"}
INTEGER_GEMM_OPS = {"MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "ConvInteger"}
PASS_THROUGH_OPS = {"Transpose", "Cast", "Reshape", "DequantizeLinear", "Identity"}


@dataclass(frozen=True)
class GraphWeights:
    initializer_bytes: int  # every initializer at its stored precision
    gemm_weight_bytes: int  # initializers that are a GEMM/convolution weight (pre-packed on the CPU)
    fp32_bytes: int  # the FP32 part (halved in a TensorRT FP16 plan)


def _itemsize(elem_type: int) -> int:
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(elem_type).itemsize


def _numel(dims) -> int:
    return math.prod(int(d) for d in dims) if len(dims) else 1


def graph_weights(model) -> GraphWeights:
    from onnx import TensorProto

    sizes = {t.name: _numel(t.dims) * _itemsize(t.data_type) for t in model.graph.initializer}
    fp32 = sum(_numel(t.dims) * 4 for t in model.graph.initializer if t.data_type == TensorProto.FLOAT)
    producers = {out: node for node in model.graph.node for out in node.output}

    def source(name: str, depth: int = 0) -> str | None:
        if name in sizes:
            return name
        node = producers.get(name)
        if node is None or depth > 4 or node.op_type not in PASS_THROUGH_OPS or not node.input:
            return None
        return source(node.input[0], depth + 1)

    packed = set()
    for node in model.graph.node:
        if node.op_type in GEMM_OPS:
            for name in node.input[1:2] if node.op_type != "QLinearMatMul" else node.input[3:4]:
                found = source(name)
                if found:
                    packed.add(found)
    return GraphWeights(sum(sizes.values()), sum(sizes[n] for n in packed), fp32)


def live_peak(model, input_dims: dict[str, list[int]]) -> tuple[int, int]:
    """(the live peak in bytes, the graph outputs' bytes) at the given input shapes: shape inference,
    then a walk in execution order that allocates each node's outputs and frees every intermediate
    after its last consumer."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for tensor in fixed.graph.input:
        if tensor.name in input_dims:
            for dim, value in zip(tensor.type.tensor_type.shape.dim, input_dims[tensor.name]):
                dim.ClearField("dim_param")
                dim.dim_value = int(value)
    inferred = SymbolicShapeInference.infer_shapes(fixed, auto_merge=True)
    sizes = {}
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        tensor_type = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if tensor_type.HasField("shape") and None not in dims:
            sizes[info.name] = _numel(dims) * _itemsize(tensor_type.elem_type)
    keep = {t.name for t in inferred.graph.initializer} | {t.name for t in inferred.graph.input}
    outputs = {t.name for t in inferred.graph.output}
    last_use = {}
    for index, node in enumerate(inferred.graph.node):
        for name in node.input:
            last_use[name] = index
    live = peak = 0
    for index, node in enumerate(inferred.graph.node):
        live += sum(sizes.get(name, 0) for name in node.output)
        peak = max(peak, live)
        for name in set(node.input):
            if name in sizes and name not in keep and name not in outputs and last_use.get(name) == index:
                live -= sizes[name]
    return peak, sum(sizes.get(name, 0) for name in outputs)
