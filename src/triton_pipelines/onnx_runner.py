"""Batch execution of an ONNX model for the embedded target's compute models.

The embedded ``tritonserver`` build has no ONNX Runtime backend, so each compute model runs as a
Python-backend model with the same name, tensors and batching as the native one. Triton hands the
Python backend the dynamic batch as a list of requests; this class runs them as one ONNX Runtime
call per group of equal trailing shapes (with length buckets that is one group), then splits the
outputs back per request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np


class OnnxBatchRunner:
    def __init__(self, model_path: Path | str, intra_op_threads: int = 0,
                 output_names: Sequence[str] | None = None, pad_ragged: bool = False):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = list(output_names or [o.name for o in self.session.get_outputs()])
        # Ragged batching (config: allow_ragged_batch on the inputs): requests of different
        # sequence lengths are zero-padded on axis 1 into one batch, and outputs that carry that
        # axis are cut back to each request's length. Only for models whose padding is masked.
        self.pad_ragged = pad_ragged

    def run(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """``requests[i]`` maps input name → array with a leading batch axis; returns the same
        structure for outputs, in request order."""
        results: list[dict[str, np.ndarray] | None] = [None] * len(requests)
        if self.pad_ragged and len(requests) > 1:
            return self._run_padded(requests)
        groups: dict[tuple, list[int]] = {}
        for index, request in enumerate(requests):
            signature = tuple(request[name].shape[1:] for name in self.input_names)
            groups.setdefault(signature, []).append(index)
        for indices in groups.values():
            sizes = [requests[i][self.input_names[0]].shape[0] for i in indices]
            if len(indices) == 1:
                feeds = dict(requests[indices[0]])
            else:
                feeds = {name: np.concatenate([requests[i][name] for i in indices]) for name in self.input_names}
            outputs = self.session.run(self.output_names, {n: feeds[n] for n in self.input_names})
            offsets = np.cumsum([0] + sizes)
            for position, index in enumerate(indices):
                start, stop = offsets[position], offsets[position + 1]
                results[index] = {name: out[start:stop] for name, out in zip(self.output_names, outputs)}
        return results  # type: ignore[return-value]

    def _run_padded(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        lengths = [request[self.input_names[0]].shape[1] for request in requests]
        longest = max(lengths)
        feeds = {}
        for name in self.input_names:
            parts = [r[name] if r[name].shape[1] == longest else
                     np.pad(r[name], [(0, 0), (0, longest - r[name].shape[1])] + [(0, 0)] * (r[name].ndim - 2))
                     for r in requests]
            feeds[name] = np.concatenate(parts)
        outputs = self.session.run(self.output_names, feeds)
        offsets = np.cumsum([0] + [r[self.input_names[0]].shape[0] for r in requests])
        results = []
        for position, length in enumerate(lengths):
            start, stop = offsets[position], offsets[position + 1]
            results.append({name: out[start:stop, :length] if out.ndim > 1 and out.shape[1] == longest
                            else out[start:stop] for name, out in zip(self.output_names, outputs)})
        return results
