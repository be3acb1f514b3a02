"""One call shape for Triton's HTTP and gRPC clients: numpy in, numpy out.

    client = TritonClient("grpc", "localhost:8001")
    outputs = client.infer("text_embedding", {"text": np.array([[b"hello"]], dtype=object)})

    # many requests at once, answers in request order (matched by request id, not arrival)
    answers = client.infer_ordered("text_embedding_batch", [{"text": text_tensor([t])} for t in texts])

Why ``infer_ordered``: concurrent requests complete in any order (dynamic batching groups them by
shape and arrival, several instances run batches side by side, HTTP connections and gRPC calls are
independent), and a model's ``preserve_ordering`` only orders the responses its own scheduler sends
back, in the order it received the requests, which is not the order a client sent them on several
connections. The helper gives each request an id and puts each answer back at its request's place.
"""

from __future__ import annotations

import secrets
import threading
from typing import Mapping, Sequence

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from triton_pipelines.limits import REQUEST_TIMEOUT_S

__all__ = ["TritonClient", "InferenceServerException"]


class TritonClient:
    def __init__(self, protocol: str, url: str, network_timeout_s: float = REQUEST_TIMEOUT_S, concurrency: int = 1):
        """``concurrency``: HTTP connections for ``infer_ordered`` (gRPC multiplexes one channel)."""
        if protocol not in ("http", "grpc"):
            raise ValueError(f"protocol must be 'http' or 'grpc', not {protocol!r}")
        self.protocol = protocol
        self.module = httpclient if protocol == "http" else grpcclient
        self.concurrency = max(1, concurrency)
        if protocol == "http":
            self.client = httpclient.InferenceServerClient(
                url, connection_timeout=network_timeout_s, network_timeout=network_timeout_s,
                concurrency=self.concurrency)
        else:
            self.client = grpcclient.InferenceServerClient(url)

    def _inputs(self, inputs: Mapping[str, np.ndarray]) -> list:
        infer_inputs = []
        for name, array in inputs.items():
            tensor = self.module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            infer_inputs.append(tensor)
        return infer_inputs

    def _outputs(self, result) -> dict[str, np.ndarray]:
        response = result.get_response()
        names = [o["name"] for o in response["outputs"]] if self.protocol == "http" else [
            o.name for o in response.outputs]
        return {name: result.as_numpy(name) for name in names}

    def _response_id(self, result) -> str:
        response = result.get_response()
        return response.get("id", "") if self.protocol == "http" else response.id

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None,
              parameters: Mapping[str, object] | None = None, request_id: str = "",
              model_version: str = "") -> dict[str, np.ndarray]:
        requested = [self.module.InferRequestedOutput(name) for name in outputs] if outputs else None
        result = self.client.infer(model, self._inputs(inputs), outputs=requested, parameters=parameters,
                                   request_id=request_id, model_version=model_version)
        return self._outputs(result)

    def infer_ordered(self, model: str, requests: Sequence[Mapping[str, np.ndarray]],
                      outputs: Sequence[str] | None = None, parameters: Mapping[str, object] | None = None,
                      max_in_flight: int = 16, return_errors: bool = False) -> list:
        """Send ``requests`` concurrently (at most ``max_in_flight`` at once; over HTTP at most the
        client's ``concurrency``) and return their outputs in request order, each matched to its
        request by the id it was sent with and Triton echoed. A failed request raises its
        ``InferenceServerException`` (the first in request order, once all are answered), or with
        ``return_errors`` takes its place in the list."""
        tag = secrets.token_hex(4)
        ids = [f"{tag}-{index}" for index in range(len(requests))]
        position = {request_id: index for index, request_id in enumerate(ids)}
        answers: list = [None] * len(requests)
        done = threading.Semaphore(0)
        slots = threading.BoundedSemaphore(max(1, max_in_flight))
        requested = [self.module.InferRequestedOutput(name) for name in outputs] if outputs else None

        def finish(index: int, result, error) -> None:
            if error is None:
                echoed = self._response_id(result)
                if echoed not in position:
                    error = InferenceServerException(f"request {ids[index]}: the response carries id {echoed!r}")
                else:
                    index = position[echoed]
            answers[index] = error if error is not None else self._outputs(result)
            slots.release()
            done.release()

        pending_http = []  # HTTP: async requests on the client's connection pool, collected oldest first
        http_window = min(self.concurrency, max(1, max_in_flight))
        for index, (request_id, inputs) in enumerate(zip(ids, requests)):
            if self.protocol == "grpc":
                slots.acquire()
                self.client.async_infer(model, self._inputs(inputs), outputs=requested, parameters=parameters,
                                        request_id=request_id,
                                        callback=lambda result, error, index=index: finish(index, result, error))
                continue
            if len(pending_http) >= http_window:
                self._collect_http(pending_http.pop(0), finish)
            slots.acquire()
            pending_http.append((index, self.client.async_infer(
                model, self._inputs(inputs), outputs=requested, parameters=parameters, request_id=request_id)))
        for item in pending_http:
            self._collect_http(item, finish)
        for _ in requests:
            done.acquire()
        errors = [a for a in answers if isinstance(a, Exception)]
        if errors and not return_errors:
            raise errors[0]
        return answers

    @staticmethod
    def _collect_http(item, finish) -> None:
        index, pending = item
        try:
            result, error = pending.get_result(), None
        except InferenceServerException as exception:
            result, error = None, exception
        finish(index, result, error)

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
