"""Greedy Whisper decoding driven by BLS calls to ``whisper_encoder`` and ``whisper_decoder``.

All requests of one dynamic batch are decoded together, one encoder call's worth of windows at a
time (``encoder_max_batch_size``: ``speech.jobs.decode_group_size``): one encoder call per group, then
every decoder step is one call for the group's windows still running. The cross-attention K/V do not
change between steps: on the gpu target they are passed on as the encoder response's own (device)
tensors; on the embedded target, where every BLS input is copied into the callee's stub, the first
step sends them and later steps name the decoder's cached copy (``input_cache_key``); there the
decoder also keeps the self-attention K/V between steps (later steps send only the new tokens and
get only the logits). A request whose client has gone (cancelled, or past the gRPC deadline the
screen forwards, or marked on its cancel board: an ensemble's running step is never cancelled by
Triton 2.51) stops decoding within 0.1 s and is answered CANCELLED. Without a language (or ``auto``) it is detected on each
item's first window in the same loop; ``timestamps: segment`` decodes with Whisper's timestamp
tokens, and ``segments`` carries their times (``window_spans``: each window's place in the clip). Request parsing, the decoding loop and the outputs:
``triton_pipelines.pipelines.speech`` (``plan_request``, ``GreedyDecoder``, ``transcript_outputs``); the BLS
calls: ``triton_pipelines.stub.whisper``."""

from triton_pipelines.cancel_board import CancelBoard
from triton_pipelines.pipelines.speech.jobs import client_gone, decode_jobs, plan_request, transcript_outputs
from triton_pipelines.stub.responses import input_array, request_parameters, respond
from triton_pipelines.stub.whisper import WhisperBls

OPTIONAL_INPUTS = ("num_windows", "language", "task", "max_new_tokens", "timestamps", "window_spans")


class TritonPythonModel:
    def initialize(self, args):
        self.whisper = WhisperBls(args)
        self.board = CancelBoard.from_environment()  # requests whose client hung up (the screen marks them)

    def execute(self, requests):
        return respond(requests, self.plan, self.decode)

    def plan(self, request):
        job = plan_request(self.whisper.tokenizer, input_array(request, "input_features"),
                           *(input_array(request, name) for name in OPTIONAL_INPUTS), **self.whisper.defaults)
        job.cancelled = client_gone(request_parameters(request), request.is_cancelled, board=self.board)
        return job

    def decode(self, jobs):
        whisper = self.whisper
        return [items if isinstance(items, Exception) else transcript_outputs(whisper.tokenizer, items, job)
                for job, items in zip(jobs, decode_jobs(jobs, whisper.group_size, whisper.group))]
