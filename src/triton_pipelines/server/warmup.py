"""End-to-end warm-up of pipelines: one small request through each ensemble.

Triton warms a model by config (``model_warmup``, generated for every compute model by the builder:
zero-filled requests run on each instance before the version is READY), but an ensemble has no
instances and cannot be warmed that way, and the Python steps of a pipeline (tokenizer, pre- and
post-processing, the BLS decode loop) have hand-written configs without warm-up samples. One real
request through each ensemble runs every step once: the rollout sends it before an ensemble gets
traffic (``warm_server``), the launcher before it says the server is ready (``warm_replicas``).

A sample is chosen by input name (the names our pipelines use): ``text`` a short sentence, ``image``
a small PNG, ``audio`` one second of silence as WAV. Optional inputs are left out, except
``max_new_tokens`` = 1 (one decoding step warms the decode loop as well as 224 would) and
``vad_filter`` false (so that the silence is decoded: VAD would leave Whisper idle).
"""

from __future__ import annotations

import io
import time
import wave
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np

SAMPLE_TEXT = "warm-up request: where is my parcel?"


def png_sample(size: int = 64) -> bytes:
    from PIL import Image

    pixels = (np.indices((size, size)).sum(axis=0) % 256).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(np.stack([pixels] * 3, axis=-1)).save(buffer, format="PNG")
    return buffer.getvalue()


def wav_sample(seconds: float = 1.0, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(rate)
        handle.writeframes(np.zeros(int(seconds * rate), dtype=np.int16).tobytes())
    return buffer.getvalue()


SAMPLES: dict[str, Callable[[], bytes]] = {"text": SAMPLE_TEXT.encode, "image": png_sample, "audio": wav_sample}
# Optional inputs sent anyway: max_new_tokens to keep the warm-up request short; vad_filter false,
# since VAD (on by default) finds no speech in the silent sample and Whisper would not run at all.
OPTIONAL_SAMPLES: dict[str, int | bool] = {"max_new_tokens": 1, "vad_filter": False}
NUMERIC_TYPES = {"TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_BOOL": np.bool_}


def sample_inputs(config: Mapping) -> dict[str, np.ndarray]:
    """One row for each required input of an ensemble (its config as the config API returns it)."""
    inputs = {}
    for tensor in config.get("input", []):
        name = tensor["name"]
        if name in OPTIONAL_SAMPLES and tensor.get("data_type") in NUMERIC_TYPES:
            inputs[name] = np.array([[OPTIONAL_SAMPLES[name]]], dtype=NUMERIC_TYPES[tensor["data_type"]])
            continue
        if tensor.get("optional"):
            continue
        if name not in SAMPLES:
            raise ValueError(f"{config['name']}: no warm-up sample for input {name!r} (known: {sorted(SAMPLES)})")
        inputs[name] = np.array([[SAMPLES[name]()]], dtype=np.object_)
    return inputs


@dataclass(frozen=True)
class Warmed:
    model: str
    seconds: float


def warm_pipelines(client, control, ensembles: Iterable[str],
                   on_error: Callable[[str, Exception], None] | None = None) -> list[Warmed]:
    """One request through each ensemble (``client``: a ``TritonClient``; ``control``: a
    ``ControlClient`` for the configs); returns those that answered. Without ``on_error`` the first
    error is raised (the rollout: a pipeline that cannot answer a warm-up request must not get
    traffic); with it, each failure is reported and the others are still warmed."""
    warmed = []
    for name in ensembles:
        try:
            inputs = sample_inputs(control.config(name))
            started = time.perf_counter()
            client.infer(name, inputs)
        except Exception as error:
            if on_error is None:
                raise
            on_error(name, error)
            continue
        warmed.append(Warmed(name, time.perf_counter() - started))
    return warmed


def warm_server(control, ensembles: Iterable[str],
                on_error: Callable[[str, Exception], None] | None = None) -> list[Warmed]:
    """``warm_pipelines`` over HTTP to the server behind ``control`` (a ``ControlClient``), with a
    client of its own, closed afterwards (the launcher's and the rollout's warm-ups)."""
    from triton_pipelines.client import TritonClient

    client = TritonClient("http", control.http_url)
    try:
        return warm_pipelines(client, control, ensembles, on_error)
    finally:
        client.close()


def warm_replica(replica, log: Callable[[str], None]) -> list[Warmed]:
    """One request through every loaded ensemble of ``replica`` (a launcher's ``Replica``;
    model_warmup warms compute models at load; an ensemble and the Python steps behind it have no
    warm-up by config); each failure is logged with ``log``."""
    control = replica.control
    ensembles = [entry["name"] for entry in control.index(ready_only=True)
                 if control.config(entry["name"]).get("platform") == "ensemble"]
    warmed = warm_server(control, sorted(set(ensembles)), on_error=lambda name, error:
                         log(f"warm-up request through {name} failed: {error}"))
    if replica.restarted:
        log(f"warmed {len(warmed)} pipelines of the restarted tritonserver{replica._which()} "
            f"in {sum(w.seconds for w in warmed):.1f} s")
    return warmed


def warm_replicas(replicas, log: Callable[[str], None]) -> list[Warmed]:
    """One request through every loaded ensemble of every replica in service (the launcher's warm-up)."""
    warmed = []
    for replica in [r for r in replicas if not r.retired]:
        warmed += warm_replica(replica, log)
    log(f"warmed {len(warmed)} pipelines end to end in {sum(w.seconds for w in warmed):.1f} s")
    return warmed
