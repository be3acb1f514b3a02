"""Encoded audio bytes → Whisper log-mel windows ``[windows, n_mels, 3000]`` per item.

Decoding, downmix, resampling and the spectrogram live in ``triton_pipelines.speech``; a bad item
fails its own request only."""

from pathlib import Path

import triton_python_backend_utils as pb_utils

from triton_pipelines.backend import error_response, model_parameters
from triton_pipelines.errors import InputError
from triton_pipelines.speech import audio_to_features, load_mel_filters, pad_windows


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.filters = load_mel_filters(version_dir / "mel_filters.npz", int(parameters["n_mels"]))
        self.limits = {"max_seconds": float(parameters["max_audio_seconds"]),
                       "max_bytes": int(parameters["max_audio_bytes"]),
                       "max_decoded_samples": int(parameters["max_decoded_samples"])}

    def execute(self, requests):
        responses = []
        for request in requests:
            items = pb_utils.get_input_tensor_by_name(request, "audio").as_numpy().reshape(-1)
            try:
                stacked, counts = pad_windows([audio_to_features(bytes(item), self.filters, index=i, **self.limits)
                                               for i, item in enumerate(items)])
            except InputError as error:
                responses.append(error_response(error))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("input_features", stacked),
                pb_utils.Tensor("num_windows", counts.reshape(-1, 1)),
            ]))
        return responses
