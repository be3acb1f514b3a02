"""Encoded audio bytes → Whisper log-mel windows ``[windows, n_mels, 3000]`` per item.

Decoding, downmix, resampling, voice activity detection (Silero VAD: optional input
``vad_filter``, true: pack, false: off; default the parameter ``vad_mode``, ``config.VAD_MODES``)
and the spectrogram live in
``triton_pipelines.pipelines.speech``; a bad item fails its own request only."""

from triton_pipelines.pipelines.speech.features import load_mel_filters, pad_time_maps, request_features, vad_modes
from triton_pipelines.pipelines.speech.vad import VAD_MODEL_FILE, SileroVad
from triton_pipelines.pipelines.speech.windows import pad_windows
from triton_pipelines.stub.model_args import model_parameters, version_dir
from triton_pipelines.stub.responses import input_array, respond


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        self.filters = load_mel_filters(version_dir(args) / "mel_filters.npz", int(parameters["n_mels"]))
        self.limits = {"max_seconds": float(parameters["max_audio_seconds"]),
                       "max_bytes": int(parameters["max_audio_bytes"]),
                       "max_decoded_samples": int(parameters["max_decoded_samples"]),
                       "min_sample_rate": int(parameters["min_sample_rate"])}
        self.vad = SileroVad(version_dir(args) / VAD_MODEL_FILE)
        self.vad_default = parameters["vad_mode"]

    def execute(self, requests):
        return respond(requests, self.features)

    def features(self, request):
        items = input_array(request, "audio").reshape(-1)
        modes = vad_modes(input_array(request, "vad_filter"), len(items), self.vad_default)
        timed = request_features(items, modes, self.filters, self.vad, **self.limits)
        stacked, counts = pad_windows([features for features, _ in timed])
        return {"input_features": stacked, "num_windows": counts.reshape(-1, 1),
                "window_spans": pad_time_maps([maps for _, maps in timed])}
