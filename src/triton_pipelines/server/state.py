"""The launcher's state folder: where our tools (drain, rollout, benchmarks, tests, ``RunningServer``)
find a running launcher. Standard library only.

``<state dir>/control.key`` holds the control key (``control.py``); ``<state dir>/server.json`` is a
``ServerState``: the internal (loopback) addresses of every tritonserver, the status server's and
the public ports. The launcher writes it once at start (``ServerState.write``) and removes it on
stop; readers use ``ServerState.read``. The folder is ``--state-dir``, else ``$TRITON_STATE_DIR``,
else ``.triton/<public HTTP port>`` (``resolve_state_dir``: the one default).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

STATE_ENV = "TRITON_STATE_DIR"
STATE_FILE = "server.json"
KEY_FILE = "control.key"
DEFAULT_HTTP_PORT = 8000


def resolve_state_dir(given: Path | str | None = None, http_port: int = DEFAULT_HTTP_PORT) -> Path:
    """The state folder: ``given``, else ``$TRITON_STATE_DIR``, else ``.triton/<http_port>``."""
    return Path(given or os.environ.get(STATE_ENV) or Path(".triton") / str(http_port))


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Create ``path`` readable by its owner only (never world-readable, not even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)


@dataclass
class ServerState:
    """``server.json``. Addresses are ``host:port``; ``triton_*`` are the first replica's."""
    launcher_pid: int = 0
    triton_http: str = ""
    triton_grpc: str = ""
    triton_metrics: str = ""
    # Every replica: {"triton_http": ..., "triton_grpc": ...}
    replicas: list[dict[str, str]] = field(default_factory=list)
    status: str = ""  # the status server (metrics, health, retire), loopback
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    listen_address: str = ""
    model_repository: str = ""
    shm_prefix: str = ""  # the first replica's Python-backend shared-memory prefix

    @classmethod
    def read(cls, directory: Path | str | None = None) -> "ServerState":
        """The state in ``directory`` (default: ``resolve_state_dir()``); fields it lacks keep their defaults.
        Raises ``FileNotFoundError`` when no launcher wrote one there."""
        data = json.loads((resolve_state_dir(directory) / STATE_FILE).read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{name: value for name, value in data.items() if name in known})

    def write(self, directory: Path) -> None:
        write_private(Path(directory) / STATE_FILE, json.dumps(asdict(self), indent=2))

    @property
    def public_host(self) -> str:
        """Where a client on this machine reaches the public ports."""
        return self.listen_address if self.listen_address not in ("0.0.0.0", "::", "") else "localhost"


def read_key(directory: Path | str | None = None) -> str:
    return (resolve_state_dir(directory) / KEY_FILE).read_text().strip()
