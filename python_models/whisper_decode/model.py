"""Greedy Whisper decoding driven by BLS calls to ``whisper_encoder`` and ``whisper_decoder``.

All requests of one dynamic batch are decoded together: their windows go through the encoder in
one call (per ``encoder_max_batch_size``), then every decoder step is one call for all windows
still running. The cross-attention K/V do not change between steps: on the gpu target they are
passed on as the encoder response's own (device) tensors; on the embedded target, where every BLS
input is copied into the callee's stub, the first step sends them and later steps name the
decoder's cached copy (``input_cache_key``). Request parsing and token selection live in
``triton_pipelines.speech``."""

import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_pipelines.backend import error_response, model_parameters
from triton_pipelines.errors import InputError
from triton_pipelines.onnx_runner import NOT_CACHED
from triton_pipelines.speech import (GreedyBatch, WhisperTokenizer, cross_names, group_windows, join_transcript,
                                     plan_request)


class BlsError(RuntimeError):
    pass


def optional_input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def gather(tensors, rows):
    """The given rows of CPU tensors, as new tensors of the same names."""
    return [pb_utils.Tensor(t.name(), np.ascontiguousarray(t.as_numpy()[rows])) for t in tensors]


class TritonPythonModel:
    def initialize(self, args):
        p = model_parameters(args)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.encoder_model, self.decoder_model = p["encoder_model"], p["decoder_model"]
        self.defaults = {"default_language": p["default_language"], "default_task": p["default_task"],
                         "default_max_new_tokens": int(p["max_new_tokens"])}
        self.encoder_batch = int(p["encoder_max_batch_size"])
        self.decoder_batch = int(p["decoder_max_batch_size"])
        # Windows decoded together. Embedded: the decoder's whole batch (the encoder's CPU outputs of
        # several calls are joined). gpu: one encoder call's worth, so its device tensors are the
        # decoder's cross K/V as they are (device tensors cannot be joined here) and the
        # self-attention K/V crossing this stub's shared memory stay bounded (docs/speech.md).
        self.group_size = self.decoder_batch if p.get("decoder_input_cache", "false") == "true" else min(
            self.decoder_batch, self.encoder_batch)
        vocab_size = int(p["vocab_size"])
        self.tokenizer = WhisperTokenizer.for_vocab_size(version_dir / "multilingual.tiktoken", vocab_size)
        self.mask, self.begin_mask = self.tokenizer.suppress_masks(vocab_size)
        self.cross_names = cross_names(int(p["decoder_layers"]))
        # Embedded target: the decoder's runner keeps the cross K/V of this instance's current batch
        # under this key, so only the first step of a batch copies them (onnx_runner.InputCache).
        self.cross_cache_key = None
        if p.get("decoder_input_cache", "false") == "true":
            self.cross_cache_key = f"{args['model_name']}/{args['model_instance_name']}/{os.getpid()}"

    def execute(self, requests):
        responses = [None] * len(requests)
        jobs = {}
        for index, request in enumerate(requests):
            try:
                jobs[index] = plan_request(
                    self.tokenizer, pb_utils.get_input_tensor_by_name(request, "input_features").as_numpy(),
                    optional_input(request, "num_windows"), optional_input(request, "language"),
                    optional_input(request, "task"), optional_input(request, "max_new_tokens"), **self.defaults)
            except InputError as error:
                responses[index] = error_response(error)
        if jobs:
            try:
                tokens = self.decode(list(jobs.values()))
            except Exception as error:  # a failed BLS call fails this batch, not the stub
                for index in jobs:
                    responses[index] = error_response(error)
            else:
                for index, job_tokens in zip(jobs, tokens):
                    responses[index] = self.respond(job_tokens)
        return responses

    def respond(self, item_tokens):
        texts = [join_transcript(self.tokenizer, windows) for windows in item_tokens]
        flat = [[t for window in windows for t in window] for windows in item_tokens]
        ids = np.full((len(flat), max(len(f) for f in flat)), -1, dtype=np.int32)
        for row, values in enumerate(flat):
            ids[row, :len(values)] = values
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("transcript", np.array([t.encode() for t in texts], dtype=np.object_).reshape(-1, 1)),
            pb_utils.Tensor("token_ids", ids),
        ])

    def decode(self, jobs):
        """→ per job, per item, per window: the generated token ids."""
        # One request per batch (the common case at low load) needs no copy of its windows.
        join = lambda arrays: arrays[0] if len(arrays) == 1 else np.concatenate(arrays)  # noqa: E731
        features = join([job.features for job in jobs])
        prompts = join([job.prompts for job in jobs])
        bounds = join([job.max_new_tokens for job in jobs])
        window_tokens = []
        for start in range(0, len(features), self.group_size):
            stop = start + self.group_size
            window_tokens += self.decode_group(features[start:stop], prompts[start:stop], bounds[start:stop])
        result, offset = [], 0
        for job in jobs:
            count = sum(job.windows_per_item)
            result.append(group_windows(window_tokens[offset:offset + count], job.windows_per_item))
            offset += count
        return result

    def decode_group(self, features, prompts, bounds):
        cross = self.encode(features)
        # Finished windows leave the batch when their rows can be gathered here (CPU tensors); with
        # the cross K/V on a GPU they stay in the batch and their tokens are ignored.
        cpu = all(t.is_cpu() for t in cross.values())
        state = GreedyBatch(prompts, self.tokenizer.eot, bounds, self.mask, compact=cpu, begin_mask=self.begin_mask)
        _, heads, _, head_dim = cross["cross_value_0"].shape()
        # Zero-length self-attention cache on the first step: [rows, 2 * layers, heads, 0, head_dim].
        past = pb_utils.Tensor("past_self_kv", np.zeros((len(prompts), len(cross), heads, 0, head_dim), np.float32))
        step_cross = list(cross.values())  # first step: the tensors themselves (a caching decoder stores them)
        cache = {} if self.cross_cache_key is None else {"input_cache_key": self.cross_cache_key}
        while not state.done:
            ids = pb_utils.Tensor("input_ids", state.next_ids)
            if cache:  # the windows still running: the decoder cuts its copy to them
                cache["input_cache_rows"] = ",".join(str(window) for window in state.active)
            try:
                outputs = self.step(ids, past, step_cross, cache)
            except BlsError as error:
                if not cache or NOT_CACHED not in str(error):
                    raise
                # Another decoder instance (or an evicted slot): send the running windows' K/V again.
                outputs = self.step(ids, past, gather(cross.values(), state.active), cache)
            rows = state.advance(outputs["logits"].as_numpy())
            present = outputs["present_self_kv"].as_numpy()
            if rows is not None:
                present = present[rows]
            if cache:
                step_cross = []
            elif rows is not None:
                step_cross = gather(step_cross, rows)
            past = pb_utils.Tensor("past_self_kv", present)
        return state.tokens

    def step(self, ids, past, cross, cache):
        return self.infer(self.decoder_model, [ids, past, *cross], ["logits", "present_self_kv"],
                          cpu_outputs=True, parameters=cache)

    def encode(self, features):
        """One BLS call per encoder batch → cross K/V tensors (the responses' own objects when one
        call covers every window)."""
        parts = []
        for start in range(0, len(features), self.encoder_batch):
            inputs = [pb_utils.Tensor("input_features", features[start:start + self.encoder_batch])]
            parts.append(self.infer(self.encoder_model, inputs, self.cross_names))
        if len(parts) == 1:
            return parts[0]
        return {name: pb_utils.Tensor(name, np.concatenate([part[name].as_numpy() for part in parts]))
                for name in parts[0]}

    def infer(self, model, inputs, outputs, cpu_outputs=False, parameters=None):
        kwargs = {"parameters": dict(parameters)} if parameters else {}
        if cpu_outputs:
            kwargs["preferred_memory"] = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)
        request = pb_utils.InferenceRequest(model_name=model, inputs=inputs,
                                            requested_output_names=outputs, **kwargs)
        response = request.exec()
        if response.has_error():
            raise BlsError(f"{model} failed: {response.error().message()}")
        return {tensor.name(): tensor for tensor in response.output_tensors()}

