"""Drain a running Triton before SIGTERM so in-flight requests finish.

Triton's own shutdown first stops every model's scheduler, then waits for in-flight requests. An
ensemble (or BLS) request in flight at that moment fails at its next step: "Server is stopping,
scheduler for model has stopped accepting new inference requests" (Triton's own bug report:
triton-inference-server/server#6287). Unloading a model instead rejects new requests to it at once
but lets its in-flight ones finish while the models it calls stay loaded. So we unload top-down,
one layer at a time: first the models nothing else calls, wait until they are gone, then the next
layer.

Callers (``ensemble_graph.EnsembleGraph``): an ensemble calls its steps' models; a Python model
declares the models it calls through BLS in its config:
``parameters { key: "bls_dependencies" value { string_value: "a,b" } }``, or ``"*"`` for every
other model (a router).
"""

from __future__ import annotations

import time
from typing import Iterable, Mapping

from triton_pipelines.server.control import ControlClient
from triton_pipelines.repository.ensemble_graph import EnsembleGraph, config_calls

# Models that a model (by its JSON config, as /v2/models/<m>/config returns it) calls.
dependencies = config_calls


def unload_layers(calls: Mapping[str, set[str]]) -> list[list[str]]:
    """Order models so that a model is unloaded only after every model that calls it."""
    return EnsembleGraph.from_calls(calls).unload_order()


def drain(control: ControlClient, timeout_s: float = 30.0, poll_s: float = 0.1,
          never_unloads: Iterable[str] = ()) -> list[list[str]]:
    """Unload every loaded model top-down; returns the layers. Bounded by ``timeout_s``.
    ``never_unloads``: models known to hold an instance Triton will not release (their unload is
    asked for, not waited for)."""
    deadline = time.monotonic() + timeout_s
    ready = sorted({m["name"] for m in control.index(ready_only=True)})
    layers = EnsembleGraph.from_configs({name: control.config(name) for name in ready}).unload_order()
    for layer in layers:
        for name in layer:
            control.unload(name)
        control.wait_unloaded(set(layer) - set(never_unloads), deadline, poll_s)
    return layers
