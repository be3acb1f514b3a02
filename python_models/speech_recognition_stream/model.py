"""Audio → transcript, streamed: a decoupled model that sends a partial transcript (``transcript``
so far, ``delta`` since the last response) as tokens are decoded and one final response
(``is_final``, ``segments``: one per 30 s window with its times), flagged final.

It does ``audio_features``' step in process (it needs each window's span in the audio) and
``whisper_decode``'s loop over BLS calls to ``whisper_encoder`` / ``whisper_decoder``: every request
of a dynamic batch is decoded together, one decoder step for all running windows
(``triton_pipelines.speech.StreamDecode``). A request whose client has gone (cancelled) stops
decoding at the next step. Request parameter ``partials: false``: only the final response."""

import os

import triton_python_backend_utils as pb_utils

from triton_pipelines.errors import InputError
from triton_pipelines.speech import (GreedyDecoder, StreamDecode, WhisperTokenizer, cross_names, decode_group_size,
                                     load_mel_filters, plan_stream_job)
from triton_pipelines.stub.bls import call, call_in_batches, gather_rows
from triton_pipelines.stub.model_args import model_parameters, version_dir
from triton_pipelines.stub.responses import error_response, input_array, output_response, request_parameters

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        p = model_parameters(args)
        self.encoder_model, self.decoder_model = p["encoder_model"], p["decoder_model"]
        self.defaults = {"default_language": p["default_language"], "default_task": p["default_task"],
                         "default_max_new_tokens": int(p["max_new_tokens"])}
        self.limits = {"max_seconds": float(p["max_audio_seconds"]), "max_bytes": int(p["max_audio_bytes"]),
                       "max_decoded_samples": int(p["max_decoded_samples"]), "min_sample_rate": int(p["min_sample_rate"])}
        self.filters = load_mel_filters(version_dir(args) / "mel_filters.npz", int(p["n_mels"]))
        self.encoder_batch = int(p["encoder_max_batch_size"])
        caches_cross = p.get("decoder_input_cache", "false") == "true"
        self.group_size = decode_group_size(int(p["decoder_max_batch_size"]), self.encoder_batch, caches_cross)
        vocab_size = int(p["vocab_size"])
        self.tokenizer = WhisperTokenizer.for_vocab_size(version_dir(args) / "multilingual.tiktoken", vocab_size)
        self.cross_names = cross_names(int(p["decoder_layers"]))
        key = f"{args['model_name']}/{args['model_instance_name']}/{os.getpid()}" if caches_cross else None
        self.decoder = GreedyDecoder(self.tokenizer, vocab_size, self.step, gather_rows, cache_key=key)

    def execute(self, requests):
        senders = [request.get_response_sender() for request in requests]
        jobs = []
        for request, sender in zip(requests, senders):
            try:
                jobs.append(self.plan(request))
            except InputError as error:
                jobs.append(None)
                sender.send(error_response(error), flags=FINAL)
        send = lambda i, outputs, final: senders[i].send(output_response(outputs), flags=FINAL if final else 0)  # noqa: E731
        try:
            StreamDecode(self.tokenizer, jobs, self.group_size, self.group, send,
                         cancelled=lambda i: senders[i].is_cancelled()).run()
        except Exception as error:  # a failed batch fails its requests, not the stub
            for job, sender in zip(jobs, senders):
                if job is not None:
                    sender.send(error_response(RuntimeError(f"speech decoding failed: {error}")), flags=FINAL)
        return None

    def plan(self, request):
        return plan_stream_job(self.tokenizer, self.filters, input_array(request, "audio"),
                               *(input_array(request, name) for name in ("language", "task", "max_new_tokens")),
                               parameters=request_parameters(request), limits=self.limits, **self.defaults)

    def group(self, features, prompts, max_new_tokens, on_step):
        cross = call_in_batches(self.encoder_model, "input_features", features, self.encoder_batch, self.cross_names)
        _, heads, _, head_dim = cross["cross_value_0"].shape()
        compact = all(tensor.is_cpu() for tensor in cross.values())
        return self.decoder.decode(prompts, max_new_tokens, cross, heads, head_dim, compact, on_step=on_step)

    def step(self, input_ids, past, cross, parameters):
        inputs = [pb_utils.Tensor("input_ids", input_ids), pb_utils.Tensor("past_self_kv", past), *cross.values()]
        outputs = call(self.decoder_model, inputs, ["logits", "present_self_kv"], cpu_outputs=True,
                       parameters=parameters)
        return outputs["logits"].as_numpy(), outputs["present_self_kv"].as_numpy()
