"""Process helpers of the launcher: children that die with it, free ports, and the Python-backend
stub processes of a ``tritonserver`` read from ``/proc`` (Linux)."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")


def terminate_with_parent() -> None:
    """In a child before exec: SIGTERM it if the launcher dies without stopping it (Linux)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class _Spawner:
    """Starts child processes from one thread that lives as long as the process.

    The kernel's parent-death signal (``terminate_with_parent``) fires when the THREAD that forked
    the child ends, not the process: a tritonserver restarted by the supervisor thread would get
    SIGTERM the moment that thread returns. Every child is forked here instead."""

    def __init__(self):
        self.requests: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def _run(self) -> None:
        while True:
            args, kwargs, reply = self.requests.get()
            try:
                reply.put((subprocess.Popen(*args, **kwargs), None))
            except BaseException as error:  # handed to the caller
                reply.put((None, error))

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="spawner", daemon=True)
                self.thread.start()
        reply: queue.Queue = queue.Queue(maxsize=1)
        self.requests.put((args, kwargs, reply))
        process, error = reply.get()
        if error is not None:
            raise error
        return process


_spawner = _Spawner()


def spawn(*args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` for a child that must die with the launcher (and only with it)."""
    return _spawner.popen(*args, preexec_fn=terminate_with_parent, **kwargs)


def free_ports(count: int) -> list[int]:
    """Ports the OS reports free right now (bound then released together)."""
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@dataclass(frozen=True)
class Stub:
    """One Python-backend stub process: ``triton_python_backend_stub <model.py> <shm region>
    <default size> <growth size> <server pid> <backend dir> <ipc handle> <instance name> ...``."""
    pid: int
    model_path: Path  # <repository>/<model>/<version>/model.py
    shm_region: str
    server_pid: int
    instance: str  # e.g. text_tokenizer_0_0

    @property
    def model(self) -> str:
        return self.model_path.parent.parent.name

    @property
    def version(self) -> str:
        return self.model_path.parent.name

    @property
    def serves_requests(self) -> bool:
        """False for the auto-complete stub: while loading a model (a new version, a reload) the
        Python backend starts a short-lived stub named after the model itself, not an instance,
        to read its ``auto_complete_config``; it exits by design once that is read."""
        return self.instance != self.model

    @property
    def identity(self) -> tuple[str, str, str]:
        """Stable across reloads (a new process of the same instance has a new pid)."""
        return self.model, self.version, self.instance


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _proc_stats():
    """(pid, the fields of /proc/<pid>/stat after the command name) of every process."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            yield int(entry.name), (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue


def group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    return [pid for pid, fields in _proc_stats() if int(fields[3]) == pgid and fields[0] != "Z"]


def kill_process_group(pgid: int, timeout_s: float = 5.0) -> int:
    """SIGKILL what is left of process group ``pgid`` (a session leader's children that outlived it,
    e.g. nginx's workers after their master was killed, still holding its ports) and wait until none
    is running. Returns how many were left."""
    left = group_pids(pgid)
    if not left:
        return 0
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return 0
    deadline = time.monotonic() + timeout_s
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(left)


def child_pids(pid: int) -> list[int]:
    """Live children of ``pid``."""
    return [child for child, fields in _proc_stats() if int(fields[1]) == pid and fields[0] != "Z"]


def find_stubs(server_pid: int | None = None) -> list[Stub]:
    """Live stub processes (of ``server_pid`` only, when given)."""
    stubs = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = _cmdline(int(entry.name))
        if len(argv) < 9 or not argv[0].endswith(STUB_BINARY) or not _alive(int(entry.name)):
            continue
        try:
            stub = Stub(int(entry.name), Path(argv[1]), argv[2], int(argv[5]), argv[8])
        except ValueError:
            continue
        if server_pid is None or stub.server_pid == server_pid:
            stubs.append(stub)
    return stubs


def remove_leftovers(server_pid: int, shm_prefix: str) -> tuple[int, int]:
    """After ``server_pid`` died: kill its orphaned stubs (they outlive a crashed server) and unlink
    its shared-memory regions. Returns (stubs killed, bytes of /dev/shm freed)."""
    killed = 0
    for stub in find_stubs(server_pid):
        try:
            os.kill(stub.pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    freed = 0
    for region in SHM_DIR.glob(f"{shm_prefix}*"):
        try:
            freed += region.stat().st_size
            region.unlink()
        except OSError:
            pass
    return killed, freed
