"""Audio → transcript, streamed: a decoupled model that sends a partial transcript (``transcript``
so far, ``delta`` since the last response) as tokens are decoded and one final response
(``is_final``, ``segments``: one per window with its times, or one per timestamp pair with
``timestamps: segment``; ``language``: given or detected), flagged final. Silero VAD as
``audio_features`` applies it: the optional input ``vad_filter``, else the parameter ``vad_mode``.

It does ``audio_features``' step in process (it needs each window's span in the audio) and
``whisper_decode``'s loop over BLS calls to ``whisper_encoder`` / ``whisper_decoder``
(``triton_pipelines.stub.whisper``): every request of a dynamic batch is decoded together, one
decoder step for all running windows (``triton_pipelines.pipelines.speech.streaming.StreamDecode``). A request whose
client has gone (cancelled, or its stream marked on the screen's cancel board) stops decoding
within 0.1 s. Request parameter ``partials: false``: only the final response."""

import triton_python_backend_utils as pb_utils

from triton_pipelines.cancel_board import CancelBoard
from triton_pipelines.errors import InputError
from triton_pipelines.pipelines.speech.features import load_mel_filters
from triton_pipelines.pipelines.speech.jobs import client_gone
from triton_pipelines.pipelines.speech.streaming import StreamDecode, plan_stream_job
from triton_pipelines.pipelines.speech.vad import VAD_MODEL_FILE, SileroVad
from triton_pipelines.stub.model_args import version_dir
from triton_pipelines.stub.responses import error_response, input_array, output_response, request_parameters
from triton_pipelines.stub.tracing import begin
from triton_pipelines.stub.whisper import WhisperBls

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.whisper = WhisperBls(args)
        p = self.whisper.parameters
        self.limits = {"max_seconds": float(p["max_audio_seconds"]), "max_bytes": int(p["max_audio_bytes"]),
                       "max_decoded_samples": int(p["max_decoded_samples"]), "min_sample_rate": int(p["min_sample_rate"])}
        self.filters = load_mel_filters(version_dir(args) / "mel_filters.npz", int(p["n_mels"]))
        # Silero VAD as audio_features applies it: the input vad_filter, else the parameter vad_mode
        self.vad = SileroVad(version_dir(args) / VAD_MODEL_FILE)
        self.vad_default = p["vad_mode"]
        self.board = CancelBoard.from_environment()  # requests whose client hung up (the screen marks them)

    def execute(self, requests):
        traced = begin(requests)  # None unless tracing (stub/tracing.py): its BLS calls join the trace
        try:
            return self.decode(requests)
        finally:
            if traced is not None:
                traced.end([])

    def decode(self, requests):
        senders = [request.get_response_sender() for request in requests]
        jobs = []
        for request, sender in zip(requests, senders):
            try:
                jobs.append(self.plan(request))
            except InputError as error:
                jobs.append(None)
                sender.send(error_response(error), flags=FINAL)
            except Exception as error:  # noqa: BLE001 - our bug fails this request in one line, not the batch
                jobs.append(None)
                sender.send(error_response(RuntimeError(f"speech planning failed: {error}")), flags=FINAL)
        gone = [client_gone(request_parameters(request), sender.is_cancelled, board=self.board)
                for request, sender in zip(requests, senders)]
        send = lambda i, outputs, final: senders[i].send(output_response(outputs), flags=FINAL if final else 0)  # noqa: E731
        try:
            StreamDecode(self.whisper.tokenizer, jobs, self.whisper.group_size, self.whisper.group, send,
                         cancelled=lambda i: gone[i]()).run()
        except Exception as error:  # a failed batch fails its requests, not the stub
            for job, sender in zip(jobs, senders):
                if job is not None:
                    sender.send(error_response(RuntimeError(f"speech decoding failed: {error}")), flags=FINAL)
        return None

    def plan(self, request):
        return plan_stream_job(self.whisper.tokenizer, self.filters, input_array(request, "audio"),
                               *(input_array(request, name)
                                 for name in ("language", "task", "max_new_tokens", "timestamps", "vad_filter")),
                               parameters=request_parameters(request), limits=self.limits, vad=self.vad,
                               vad_default=self.vad_default, **self.whisper.defaults)
