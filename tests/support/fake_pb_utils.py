"""A stand-in for ``triton_python_backend_utils`` (the module Triton's Python stub provides), enough
to run the ``model.py`` adapters in the test process: tensors, requests, responses, errors, metrics,
and BLS calls dispatched to adapters registered in ``MODELS``. It imitates the interface, not
Triton: batching, scheduling and memory are Triton's and are covered by the server tests."""

from __future__ import annotations

import json

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_MEMORY_CPU = 0
MODELS: dict = {}  # model name → an initialized TritonPythonModel, or a callable returning one per call


class TritonModelException(Exception):
    pass


class TritonError:
    INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = "INTERNAL", "INVALID_ARG", "UNAVAILABLE", "CANCELLED"

    def __init__(self, message, code=INTERNAL):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array

    def is_cpu(self):
        return True

    def shape(self):
        return list(self._array.shape)


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        self._outputs, self._error = list(output_tensors or []), error

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error

    def output_tensors(self):
        return self._outputs


class PreferredMemory:
    def __init__(self, kind, device_id):
        self.kind, self.device_id = kind, device_id


class Request:
    """What ``execute`` receives."""

    def __init__(self, inputs, parameters=None, request_id="", requested_output_names=()):
        self.inputs = {name: array if isinstance(array, Tensor) else Tensor(name, array)
                       for name, array in inputs.items()}
        self._parameters, self._id = json.dumps(parameters or {}), request_id
        self._outputs = list(requested_output_names)

    def requested_output_names(self):
        return list(self._outputs)

    def parameters(self):
        return self._parameters

    def request_id(self):
        return self._id

    cancelled = False  # set by a test: the client has gone

    def is_cancelled(self):
        return self.cancelled


def get_input_tensor_by_name(request, name):
    return request.inputs.get(name)


def get_output_tensor_by_name(response, name):
    return next((t for t in response.output_tensors() if t.name() == name), None)


class InferenceRequest:
    """A BLS request: ``exec`` runs the registered model's ``execute`` on it."""

    def __init__(self, model_name, inputs, requested_output_names, parameters=None, preferred_memory=None):
        self.model_name, self.outputs = model_name, list(requested_output_names)
        self.request = Request({t.name(): t for t in inputs}, parameters,
                               requested_output_names=requested_output_names)

    def exec(self):
        model = MODELS[self.model_name]
        (response,) = (model() if callable(model) and not hasattr(model, "execute") else model).execute([self.request])
        if response.has_error():
            return response
        return InferenceResponse([t for t in response.output_tensors() if t.name() in self.outputs])


class Metric:
    def __init__(self, labels, buckets=None):
        self.labels, self.value, self.observed = labels, 0.0, []

    def increment(self, value):
        self.value += value

    def set(self, value):
        self.value = value

    def observe(self, value):
        self.observed.append(value)


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name, self.description, self.kind, self.metrics = name, description, kind, []

    def Metric(self, labels, **options):  # noqa: N802 (Triton's name)
        metric = Metric(labels, **options)
        self.metrics.append(metric)
        return metric


class Logger:
    messages: list = []

    @classmethod
    def log_info(cls, message):
        cls.messages.append(("info", message))

    @classmethod
    def log_error(cls, message):
        cls.messages.append(("error", message))


# Decoupled models: a request's response sender.
class ResponseSender:
    def __init__(self):
        self.sent: list[tuple[object, int]] = []  # (response or None, flags)
        self.cancelled = False

    def send(self, response=None, flags=0):
        if self.sent and self.sent[-1][1] & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            raise RuntimeError("a response after the final one")
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


def _response_sender(self):
    if not hasattr(self, "_sender"):
        self._sender = ResponseSender()
    return self._sender


Request.get_response_sender = _response_sender
