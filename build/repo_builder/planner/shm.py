"""The /dev/shm plan: the shared-memory region each Python-backend stub grows to (a full batch's
inputs and outputs, its BLS calls' too), per model and in total (compose's ``TRITON_SHM_SIZE``,
Kubernetes' ``sizeLimit``)."""

from __future__ import annotations

import math

from tritonclient.grpc import model_config_pb2 as mc

from .graph import _numel
from .sizes import GiB, SHM_DEFAULT_BYTES, SHM_GROWTH_BYTES, gib


def _tensor_bytes(config: mc.ModelConfig, batch: int, sequence: dict[str, int]) -> int:
    """Inputs and outputs of one full batch (what crosses the Python backend's shared memory)."""
    import numpy as np
    from tritonclient.utils import triton_to_np_dtype

    total = 0
    for tensors in (config.input, config.output):
        for tensor in tensors:
            bound = sequence.get(tensor.name, sequence.get("", 1))
            itemsize = 1 if tensor.data_type == mc.TYPE_STRING else np.dtype(
                triton_to_np_dtype(mc.DataType.Name(tensor.data_type)[5:])).itemsize
            total += batch * _numel([d if d > 0 else bound for d in tensor.dims]) * itemsize
    return total


def _shm_region(io_bytes: int) -> int:
    if io_bytes <= SHM_DEFAULT_BYTES:
        return SHM_DEFAULT_BYTES
    return SHM_DEFAULT_BYTES + math.ceil((io_bytes - SHM_DEFAULT_BYTES) / SHM_GROWTH_BYTES) * SHM_GROWTH_BYTES



def bls_calls(config: mc.ModelConfig) -> list[tuple[str, int, dict[str, int]]]:
    """The models a Python-backend model calls (BLS), the rows one call carries and the bounds of
    their variable dims, from its parameters: their inputs and outputs cross the caller's own
    shared-memory region too. whisper_decode (and its variants): one encoder call per
    ``encoder_max_batch_size`` windows; each decoder step for the windows decoded together
    (``speech.jobs.decode_group_size``), its self-attention K/V up to Whisper's 448 positions (unless
    the decoder keeps them: ``kept_in_callee``)."""
    from triton_pipelines.pipelines.speech.config import MAX_TARGET_POSITIONS
    from triton_pipelines.pipelines.speech.jobs import decode_group_size

    p = {key: value.string_value for key, value in config.parameters.items()}
    if "encoder_model" in p and "decoder_model" in p:
        encoder, decoder = int(p["encoder_max_batch_size"]), int(p["decoder_max_batch_size"])
        return [(p["encoder_model"], encoder, {}),
                (p["decoder_model"], decode_group_size(decoder, encoder), {"": MAX_TARGET_POSITIONS})]
    return []


def stub_region_bytes(config: mc.ModelConfig, configs: dict[str, mc.ModelConfig],
                      bounds: dict[str, dict[str, int]]) -> int:
    """The shared-memory region one stub of ``config`` grows to: a full batch's inputs and outputs,
    plus those of its BLS calls at their row counts (``shm-growth-byte-size`` steps)."""
    io = _tensor_bytes(config, max(1, config.max_batch_size), bounds.get(config.name, {}))
    for callee, rows, callee_bounds in bls_calls(config):
        io += _tensor_bytes(configs[callee], rows, callee_bounds | kept_in_callee(config, configs[callee]))
    return _shm_region(io)


def kept_in_callee(caller: mc.ModelConfig, callee: mc.ModelConfig) -> dict[str, int]:
    """The callee's state pairs (its ``state_inputs``: the Whisper decoder's self-attention K/V on the
    embedded target) as bounds of 0, when the caller keys its calls (``decoder_input_cache``): the
    callee keeps them between the calls, so they never cross the caller's region (the first call's
    state is zero-length)."""
    from triton_pipelines.pipelines.onnx_runner import parse_state_pairs

    parameter = lambda config, key: config.parameters[key].string_value if key in config.parameters else ""  # noqa: E731
    if parameter(caller, "decoder_input_cache") != "true":
        return {}
    return {name: 0 for pair in parse_state_pairs(parameter(callee, "state_inputs")).items() for name in pair}


def config_versions(config: mc.ModelConfig) -> int:
    """Versions a config loads (the builder writes ``specific`` for canaries, else one)."""
    return len(config.version_policy.specific.versions) or 1


def shm_needs(configs: dict[str, mc.ModelConfig], bounds: dict[str, dict[str, int]],
              versions: dict[str, int] | None = None) -> dict[str, int]:
    """/dev/shm each Python-backend model may hold (bytes): its stubs (instances x loaded versions)
    x the region each grows to. An upper bound: outputs that a GPU backend returns in device memory
    to a BLS caller travel by CUDA IPC, not through the region."""
    needs = {}
    for name, config in sorted(configs.items()):
        if config.platform == "ensemble" or config.backend != "python":
            continue
        count = sum(g.count or 1 for g in config.instance_group) or 1
        stubs = count * (versions or {}).get(name, config_versions(config))
        needs[name] = stubs * stub_region_bytes(config, configs, bounds)
    return needs


def shm_size_text(size: int) -> str:
    """A size for compose's ``shm_size`` / Kubernetes' ``sizeLimit``: whole GiB, rounded up."""
    return f"{max(1, math.ceil(size / GiB))}gb"



def shm_report(needs: dict[str, int]) -> str:
    lines = ["| model | /dev/shm GiB (stubs x region at a full batch, BLS calls included) |", "|---|---|"]
    lines += [f"| {name} | {gib(size)} |" for name, size in needs.items()]
    total = sum(needs.values())
    lines.append(f"\ntotal {gib(total)} GiB: docker compose TRITON_SHM_SIZE={shm_size_text(total)}; Kubernetes "
                 f"sizeLimit: {shm_size_text(total)[:-2]}Gi (an upper bound: every stub at a full batch at once)")
    return "\n".join(lines)
