"""One call shape for Triton's HTTP and gRPC clients: numpy in, numpy out.

    client = TritonClient("grpc", "localhost:8001")
    outputs = client.infer("text_embedding", {"text": np.array([[b"hello"]], dtype=object)})
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

__all__ = ["TritonClient", "InferenceServerException"]


class TritonClient:
    def __init__(self, protocol: str, url: str, network_timeout_s: float = 300.0):
        if protocol not in ("http", "grpc"):
            raise ValueError(f"protocol must be 'http' or 'grpc', not {protocol!r}")
        self.protocol = protocol
        self.module = httpclient if protocol == "http" else grpcclient
        if protocol == "http":
            self.client = httpclient.InferenceServerClient(
                url, connection_timeout=network_timeout_s, network_timeout=network_timeout_s)
        else:
            self.client = grpcclient.InferenceServerClient(url)

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None,
              parameters: Mapping[str, object] | None = None, request_id: str = "",
              model_version: str = "") -> dict[str, np.ndarray]:
        infer_inputs = []
        for name, array in inputs.items():
            tensor = self.module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            infer_inputs.append(tensor)
        requested = [self.module.InferRequestedOutput(name) for name in outputs] if outputs else None
        result = self.client.infer(model, infer_inputs, outputs=requested, parameters=parameters,
                                   request_id=request_id, model_version=model_version)
        response = result.get_response()
        names = [o["name"] for o in response["outputs"]] if self.protocol == "http" else [
            o.name for o in response.outputs]
        return {name: result.as_numpy(name) for name in names}

    def is_server_ready(self) -> bool:
        return self.client.is_server_ready()

    def is_model_ready(self, model: str, version: str = "") -> bool:
        return self.client.is_model_ready(model, version)

    def statistics(self, model: str) -> dict:
        if self.protocol == "http":
            return self.client.get_inference_statistics(model)
        return self.client.get_inference_statistics(model, as_json=True)

    def close(self) -> None:
        self.client.close()


def text_tensor(texts: Sequence[str | bytes]) -> np.ndarray:
    """A [batch, 1] BYTES tensor, the shape of every text/image/audio pipeline input."""
    return np.array([t.encode() if isinstance(t, str) else t for t in texts], dtype=np.object_).reshape(-1, 1)
