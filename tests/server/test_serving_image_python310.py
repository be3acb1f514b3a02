"""The serving image's Python (3.10, the NGC 24.10 image's) serves the repository with the 3.10 stub
that nvidia-pytriton ships, from a venv holding the serving requirements (built by the wheel
fixture of tests/unit/deploy/test_images.py), and the pipeline tests pass against it."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from triton_pipelines.server.launcher import free_ports
from triton_pipelines.server.processes import find_stubs

from tests.conftest import LOG_DIR, PROJECT_ROOT, ensure_repository



def python310() -> str | None:
    """A working python3.10: pyenv's (its shim fails unless 3.10 is selected), else one on PATH."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [str(p) for p in sorted(pyenv.glob("versions/3.10.*/bin/python3.10"), reverse=True)]
    candidates += [c for c in (shutil.which("python3.10"),) if c]
    for candidate in candidates:
        if subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 10)"],
                          capture_output=True).returncode == 0:
            return candidate
    return None


REHEARSAL_EXTRAS = ["nvidia-pytriton==0.7.0", "onnxruntime==1.23.2"]


REHEARSED_TESTS = ["tests/server/test_text_server.py", "tests/server/test_vision_server.py", "tests/server/test_speech_server.py",
                   "tests/server/test_router_server.py"]


NOT_REHEARSED = " and ".join(f"not {name}" for name in (
    "test_canary_version_2_is_the_int8_model", "grpc", "test_wav_variants", "test_canary_split",
    "test_without_the_decoder_cache", "test_decoder_instance_without_the_cached_kv", "test_concurrent_requests"))


@pytest.fixture(scope="module")
def serving_venv_310(wheel) -> Path:
    interpreter = python310()
    if interpreter is None:
        pytest.skip("no Python 3.10 interpreter here (pyenv install 3.10): the serving image's Python "
                    "cannot be rehearsed")
    requirements = (PROJECT_ROOT / "requirements-serving.txt").read_text()
    stamp = hashlib.sha256((requirements + " ".join(REHEARSAL_EXTRAS)).encode()).hexdigest()
    venv = LOG_DIR / "py310-serving"
    if not (venv / ".stamp").exists() or (venv / ".stamp").read_text() != stamp:
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([interpreter, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        "-r", str(PROJECT_ROOT / "requirements-serving.txt"), *REHEARSAL_EXTRAS],
                       check=True, timeout=1200)
        (venv / ".stamp").write_text(stamp)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
                    "--force-reinstall", str(wheel)], check=True, timeout=300)
    return venv


def test_the_serving_python_310_serves_the_pipelines(serving_venv_310, tmp_path):
    python = serving_venv_310 / "bin" / "python"
    version = subprocess.run([str(python), "-c", "import sys, numpy; print(sys.version_info[:2], numpy.__version__)"],
                             capture_output=True, text=True, check=True).stdout
    assert version.startswith("(3, 10)") and "1.26" in version
    http, grpc, metrics = free_ports(3)
    state = tmp_path / "state"
    log = open(LOG_DIR / "py310-server.log", "wb")
    server = subprocess.Popen([str(python), "-m", "triton_pipelines", "serve", "--model-repository",
                               str(ensure_repository()), "--http-port", str(http), "--grpc-port", str(grpc),
                               "--metrics-port", str(metrics), "--state-dir", str(state)],
                              cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while "Triton is ready" not in (LOG_DIR / "py310-server.log").read_text(errors="replace"):
            assert server.poll() is None, (LOG_DIR / "py310-server.log").read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the 3.10 server was not ready in 10 minutes"
            time.sleep(1)
        (triton,) = [int(p) for p in subprocess.run(["pgrep", "-P", str(server.pid), "tritonserver"],
                                                     capture_output=True, text=True).stdout.split()]
        stubs = find_stubs(triton)
        assert stubs and all("libpython3.10" in Path(f"/proc/{stub.pid}/maps").read_text() for stub in stubs)
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", NOT_REHEARSED,
                              *REHEARSED_TESTS], cwd=PROJECT_ROOT, env=dict(os.environ, TEST_SERVER_STATE=str(state)),
                             capture_output=True, text=True, timeout=1800)
        (LOG_DIR / "py310-tests.log").write_text(run.stdout + run.stderr)
        summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
        print(f"pipeline tests against the Python 3.10 server: {summary}")
        failures = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
        assert run.returncode == 0, "\n".join(failures) + "\n(full output: .cache/py310-tests.log)"
        assert " passed" in summary and "failed" not in summary
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    assert server.returncode == 0, (LOG_DIR / "py310-server.log").read_text(errors="replace")[-3000:]
