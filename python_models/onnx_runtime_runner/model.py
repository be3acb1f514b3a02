"""Embedded target only: a compute model (same name, tensors and batching as the native
``onnxruntime_onnx`` one) served by the Python backend running ONNX Runtime on the CPU.
The builder generates this model's config from the compute model's description.

Config parameter ``cached_inputs`` (comma-separated, optional): inputs a BLS caller may send once
with the request parameter ``input_cache_key`` and then omit, naming the key (and, with
``input_cache_rows``, the rows still wanted); ``input_cache_entries`` (default 8) bounds the keys
kept. See ``triton_pipelines.onnx_runner.InputCache``."""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from triton_pipelines.backend import error_response, model_parameters
from triton_pipelines.errors import InputError
from triton_pipelines.onnx_runner import InputCache, OnnxBatchRunner, engine_cache_dir, parse_rows


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = model_parameters(args)
        self.model_name = args["model_name"]
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.input_names = [i["name"] for i in config["input"]]
        self.output_names = [o["name"] for o in config["output"]]
        self.runner = OnnxBatchRunner(
            version_dir / parameters.get("onnx_file", "model.onnx"),
            intra_op_threads=int(parameters.get("intra_op_threads", "0")),
            output_names=self.output_names,
            pad_ragged=any(i.get("allow_ragged_batch", False) for i in config["input"]),
            execution_providers=parameters.get("execution_providers", "cpu").split(","),
            engine_cache_dir=engine_cache_dir(self.model_name),
            spin_wait=parameters.get("intra_op_spin_wait", "true") == "true",
        )
        cached = [name for name in parameters.get("cached_inputs", "").split(",") if name]
        self.cache = InputCache(cached, int(parameters.get("input_cache_entries", "8"))) if cached else None

    def execute(self, requests):
        responses = [None] * len(requests)
        batched, batched_feeds = [], []
        for index, request in enumerate(requests):
            try:
                feeds, cache_key = self.feeds(request)
            except InputError as error:
                responses[index] = error_response(error)
                continue
            if cache_key is None:
                batched.append(index)
                batched_feeds.append(feeds)
            else:  # its cached tensors are this caller's own: run alone rather than copy them into a batch
                responses[index] = self.run([feeds])[0]
        if batched:
            for index, response in zip(batched, self.run(batched_feeds)):
                responses[index] = response
        return responses

    def feeds(self, request):
        """→ (input name → array, the input cache key or None)."""
        feeds = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                feeds[name] = tensor.as_numpy()
        parameters = json.loads(request.parameters() or "{}")
        key = parameters.get("input_cache_key")
        if key is None or self.cache is None:
            missing = [name for name in self.input_names if name not in feeds]
            if missing:
                raise InputError(f"{self.model_name}: missing inputs {missing}"
                                 + (" (or an input_cache_key naming them)" if self.cache else ""))
            return feeds, None
        rows = parameters.get("input_cache_rows")
        feeds.update(self.cache.resolve(str(key), feeds, None if rows is None else parse_rows(str(rows))))
        return feeds, key

    def run(self, feeds):
        try:
            results = self.runner.run(feeds)
        except Exception as error:  # an ONNX Runtime failure fails these requests, not the server
            return [error_response(RuntimeError(f"{self.model_name}: ONNX Runtime failed: {error}"))
                    for _ in feeds]
        return [pb_utils.InferenceResponse([pb_utils.Tensor(name, result[name]) for name in self.output_names])
                for result in results]
