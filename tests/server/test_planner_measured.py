"""The memory planner's CPU estimates against the measured memory of each compute model's stub, on
the compute-models server (not the session server)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from repo_builder.planner.estimates import Repository
from triton_pipelines.client import TritonClient
from triton_pipelines.server.processes import find_stubs

from tests.conftest import ensure_repository, image_classifier



TOLERANCE = 0.25


def decoder_request(rows: int, past: int) -> dict[str, np.ndarray]:
    """A whisper_decoder request for the architecture that was built (read from its config)."""
    config = text_format.Parse((ensure_repository() / "whisper_decoder" / "config.pbtxt").read_text(), mc.ModelConfig())
    dims = {tensor.name: list(tensor.dims) for tensor in config.input}
    request = {"input_ids": np.zeros((rows, 4), np.int64)}
    for name, shape in dims.items():
        if name != "input_ids":
            request[name] = np.zeros([rows] + [past if d == -1 else d for d in shape], np.float32)
    return request


IMAGE_CLASSIFIER = "<the image classifier>"  # the built one's name, found at run time (image_classifier)
CASES = [
    ("text_encoder", 1, 16, {"": 128}, {"input_ids": np.full((16, 128), 2000, np.int64),
                                        "attention_mask": np.ones((16, 128), np.int64)}),
    ("text_encoder", 2, 16, {"": 128}, {"input_ids": np.full((16, 128), 2000, np.int64),
                                        "attention_mask": np.ones((16, 128), np.int64)}),
    (IMAGE_CLASSIFIER, 1, 8, {}, {"pixel_values": np.zeros((8, 3, 224, 224), np.float32)}),
    ("whisper_encoder", 1, 2, {}, {"input_features": np.zeros((2, 80, 3000), np.float32)}),
    # One window: base's cross K/V are 37 MB a window (the body limit is 64 MiB).
    ("whisper_decoder", 1, 1, {"input_ids": 4, "past_self_kv": 32}, lambda: decoder_request(1, 32)),
]


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_cpu_estimates_are_within_25_percent_of_the_measured_stubs(compute_server):
    """Each case on fresh instances (the model loaded again with a changed parameter: a new stub,
    an empty arena; its model_warmup runs at load), one request at the case's shape, then the
    stub's peak RSS against the planner's estimate for that shape."""
    repository = Repository(ensure_repository())
    server = compute_server
    client = TritonClient("grpc", server.grpc_url)
    rows = []
    for generation, (model, version, batch, bounds, request) in enumerate(CASES):
        model = image_classifier() if model == IMAGE_CLASSIFIER else model
        config = server.control.config(model)
        config.setdefault("parameters", {})["planner_test"] = {"string_value": str(generation)}
        before = {s.pid for s in find_stubs(server.process.pid)}
        server.control.load(model, config=config)
        client.infer(model, request() if callable(request) else request, model_version=str(version))
        (stub,) = [s for s in find_stubs(server.process.pid) if s.serves_requests and s.pid not in before
                   and (s.model, s.version) == (model, str(version))]
        measured = peak_rss(stub.pid)
        estimate = repository.estimate(model, version, batch, bounds)
        rows.append((model, version, batch, bounds, estimate, measured))
    client.close()
    for model, version, batch, bounds, estimate, measured in rows:
        parts = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in estimate.items() if k != "total")
        print(f"{model} v{version} batch {batch} {bounds}: estimate {estimate['total'] / 2**20:.0f} MiB ({parts}), "
              f"measured {measured / 2**20:.0f} MiB: {estimate['total'] / measured - 1:+.0%}")
    for model, version, batch, bounds, estimate, measured in rows:
        assert abs(estimate["total"] / measured - 1) <= TOLERANCE, (model, version, estimate, measured)
