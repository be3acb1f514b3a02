"""Which models of a repository a server's backend folder can load.

tritonserver exits at start (``--exit-on-error`` is its default) when one model fails to load, and a
model whose backend has no folder under ``--backend-directory`` always fails. The launcher uses this
to leave such models out, with one log line naming them, instead of starting a server that dies (a
container that restart-loops with the reason buried in Triton's log). On the NGC image every backend
our repositories name is there and nothing changes; ``make rehearse``'s stand-in for it has only the
Python backend (no ONNX Runtime/TensorRT, no GPU), so the gpu target's compute models, and the
ensembles built on them, are left out there and reported.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# Triton's platform names and the backend that serves each.
PLATFORM_BACKENDS = {"onnxruntime_onnx": "onnxruntime", "tensorrt_plan": "tensorrt",
                     "pytorch_libtorch": "pytorch", "tensorflow_graphdef": "tensorflow",
                     "tensorflow_savedmodel": "tensorflow", "openvino": "openvino"}
_BACKEND = re.compile(r'^\s*backend\s*:\s*"([^"]+)"', re.M)
_PLATFORM = re.compile(r'^\s*platform\s*:\s*"([^"]+)"', re.M)
_STEP_MODEL = re.compile(r'\bmodel_name\s*:\s*"([^"]+)"')


def needs(config_text: str) -> tuple[str | None, set[str]]:
    """(backend the model needs, or None for an ensemble; models its ensemble steps name)."""
    backend = _BACKEND.search(config_text)
    platform = _PLATFORM.search(config_text)
    if backend:
        return backend.group(1), set()
    if platform and platform.group(1) == "ensemble":
        return None, set(_STEP_MODEL.findall(config_text))
    return (PLATFORM_BACKENDS.get(platform.group(1), platform.group(1)) if platform else None), set()


def unloadable(repository: Path, backend_dir: Path) -> dict[str, str]:
    """Model -> why it cannot load from ``backend_dir``: its backend has no folder there, or (an
    ensemble) a step names such a model or one missing from the repository."""
    configs = {p.parent.name: p.read_text() for p in sorted(Path(repository).glob("*/config.pbtxt"))}
    required = {name: needs(text) for name, text in configs.items()}
    why: dict[str, str] = {}
    for name, (backend, _) in required.items():
        if backend is not None and not (Path(backend_dir) / backend).is_dir():
            why[name] = f"backend {backend!r} not in {backend_dir}"
    changed = True
    while changed:  # ensembles of ensembles
        changed = False
        for name, (_, steps) in required.items():
            if name in why:
                continue
            blocked = sorted(s for s in steps if s in why or s not in configs)
            if blocked:
                why[name] = f"ensemble step {blocked[0]} cannot load"
                changed = True
    return why


def models_to_load(repository: Path, backend_dir: Path) -> list[str] | None:
    """What the launcher asks tritonserver to load: None (every model, ``--load-model=*``) when the
    backend folder serves them all, else the models it can serve, after one log line naming the rest
    and why. None too when it can serve none (tritonserver then says why each fails)."""
    missing = unloadable(repository, backend_dir)
    if not missing:
        return None
    print(f"[launcher] not loading {len(missing)} models this server's backends cannot serve: "
          + "; ".join(f"{name} ({why})" for name, why in sorted(missing.items())), file=sys.stderr, flush=True)
    loadable = sorted({p.parent.name for p in Path(repository).glob("*/config.pbtxt")} - set(missing))
    return loadable or None
