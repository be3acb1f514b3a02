"""Start a peer as a child process on a free loopback port, wait until it answers, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from triton_pipelines.server.processes import free_ports

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class PeerProcess:
    name: str
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pss_bytes(self) -> int:
        """Memory (PSS, as for Triton's processes: shared pages counted once) of the peer's process
        tree (the server and any worker it forked)."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            return sum(p.memory_full_info().pss for p in [root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            return 0

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_peer(name: str, command: list[str], health_path: str = "/health", env: dict | None = None,
               timeout_s: float = 600.0, log_dir: Path = ROOT / ".bench", cwd: Path = ROOT) -> PeerProcess:
    """``command`` gets ``{port}`` substituted; the peer is ready when GET health_path answers 200."""
    (port,) = free_ports(1)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"peer-{name}.log"
    log = open(log_path, "wb")
    process = subprocess.Popen([part.replace("{port}", str(port)) for part in command], stdout=log, stderr=log,
                               cwd=cwd, env={**os.environ, **(env or {})}, start_new_session=True)
    peer = PeerProcess(name, process, port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"peer {name} exited ({process.returncode}):\n"
                               + log_path.read_text(errors="replace")[-3000:])
        try:
            with urllib.request.urlopen(peer.base_url + health_path, timeout=2) as response:
                if response.status == 200:
                    return peer
        except OSError:
            pass
        time.sleep(0.5)
    peer.stop()
    raise RuntimeError(f"peer {name} did not answer within {timeout_s:.0f} s:\n"
                       + log_path.read_text(errors="replace")[-3000:])


def start_fastapi_peer(pipeline: str, repository: Path, env: dict | None = None) -> PeerProcess:
    return start_peer(f"fastapi-{pipeline}", [sys.executable, "-m", "benchmarks.peers", pipeline,
                                              "--repository", str(repository), "--port", "{port}"], env=env)
