"""Encoded audio bytes → Whisper log-mel windows ``[windows, n_mels, 3000]`` per item.

Decoding, downmix, resampling and the spectrogram live in ``triton_pipelines.pipelines.speech``; a bad item
fails its own request only."""

from triton_pipelines.pipelines.speech.features import audio_to_timed_features, load_mel_filters, pad_spans
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

    def execute(self, requests):
        return respond(requests, self.features)

    def features(self, request):
        items = input_array(request, "audio").reshape(-1)
        timed = [audio_to_timed_features(bytes(item), self.filters, index=i, **self.limits) for i, item in enumerate(items)]
        stacked, counts = pad_windows([features for features, _ in timed])
        return {"input_features": stacked, "num_windows": counts.reshape(-1, 1),
                "window_spans": pad_spans([spans for _, spans in timed], stacked.shape[1])}
