"""nginx supervised: the public front (``front/nginx_config.py`` renders its configuration) run in
the foreground as a child of the launcher, which restarts it if it dies.

``ProxyProcess`` writes the rendered configuration under the state folder, checks it with ``nginx -t``
before nginx starts or reloads, reloads it gracefully when the replicas in service change, and gives
the workers their temp folders (large request bodies) at run time.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from triton_pipelines.front.nginx_config import ProxyConfig, gate_socket, render_config
from triton_pipelines.server.processes import child_pids, kill_process_group, spawn


def nginx_binary() -> str:
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                           if os.access(p, os.X_OK)), None)
    if found is None:
        raise RuntimeError("nginx is not installed: `make install` installs it (Debian package nginx-core); "
                           "the container image has it")
    return found


TEMP_FOLDERS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def worker_temp_dir(state: Path, run_as: str | None) -> Path:
    """Where nginx's workers write request bodies larger than their buffer. Started as root, the
    workers run as ``run_as`` and must reach the folder: the state folder may sit under a private
    one (/root, a 0700 temp folder), so they get a folder of their own under the system's temp
    folder (world-traversable), owned by them."""
    if not run_as:
        for name in TEMP_FOLDERS:
            (state / name).mkdir(exist_ok=True)
        return state
    import pwd

    user = pwd.getpwnam(run_as.split()[0])
    temp = Path(tempfile.mkdtemp(prefix="triton-proxy-"))
    os.chmod(temp, 0o711)  # traverse, not list
    for name in TEMP_FOLDERS:
        (temp / name).mkdir(mode=0o700)
        os.chown(temp / name, user.pw_uid, user.pw_gid)
    return temp


class ProxyProcess:
    """nginx in the foreground with a generated configuration under ``config.state_dir``."""

    def __init__(self, config: ProxyConfig, stdout=None, stderr=None):
        self.config = config
        state = config.state_dir
        state.mkdir(parents=True, exist_ok=True)
        self.temp_dir = worker_temp_dir(state, config.run_as)
        self.config_path = state / "nginx.conf"
        self.config_path.write_text(render_config(config, self.temp_dir))
        self.binary = nginx_binary()
        self.validate(self.config_path, state)
        self.stdout, self.stderr = stdout, stderr
        self.process = self._start()

    def validate(self, path: Path, prefix: Path) -> None:
        """``nginx -t`` on the configuration at ``path`` (``prefix``: the state folder); raises if invalid."""
        check = subprocess.run([self.binary, *self._error_log(), "-t", "-q", "-p", str(prefix), "-c", str(path)],
                               capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"the generated nginx configuration is invalid: {check.stderr.strip()}")

    def _error_log(self) -> list[str]:
        """``-e stderr`` (nginx >= 1.19.5): a non-root nginx would first try /var/log/nginx/error.log."""
        version = subprocess.run([self.binary, "-v"], capture_output=True, text=True).stderr
        found = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", version)
        return ["-e", "stderr"] if found and tuple(map(int, found.groups())) >= (1, 19, 5) else []

    def _start(self) -> subprocess.Popen:
        # nginx removes its Unix socket when it exits, not when it is killed, and cannot bind over one
        gate_socket(self.temp_dir).unlink(missing_ok=True)
        return spawn([self.binary, *self._error_log(), "-p", str(self.config.state_dir), "-c", str(self.config_path)],
                     stdout=self.stdout, stderr=self.stderr, start_new_session=True)

    def restart(self) -> None:
        self._stop_process()
        self.process = self._start()

    def reconfigure(self, config: ProxyConfig, timeout_s: float = 60, wait: bool = True) -> None:
        """New upstreams (replicas in service) without dropping a request: nginx's graceful reload
        starts workers on the new configuration while the old ones finish what they are serving.
        Returns when the old workers are gone (no request is on its way to a removed upstream), or at
        once with ``wait=False`` (the supervisor's reconcile pass, which never waits)."""
        text = render_config(config, self.temp_dir)
        if text == self.config_path.read_text():
            return
        old_workers = set(child_pids(self.process.pid))
        candidate = self.config_path.with_suffix(".next")
        candidate.write_text(text)
        self.validate(candidate, config.state_dir)
        os.replace(candidate, self.config_path)
        self.config = config
        self.process.send_signal(signal.SIGHUP)
        if not wait:
            return
        deadline = time.monotonic() + timeout_s
        while old_workers & set(child_pids(self.process.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10) -> None:
        self._stop_process(timeout_s)
        if self.temp_dir != self.config.state_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _stop_process(self, timeout_s: float = 10) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # graceful: finish requests in flight
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # The master leads its own process group (start_new_session): workers that outlived it (a
        # master killed with SIGKILL) would hold the public ports on the old configuration and make
        # every restart fail to bind.
        left = kill_process_group(self.process.pid)
        if left:
            print(f"[nginx] killed {left} worker(s) left by the old master (pid {self.process.pid})",
                  file=sys.stderr, flush=True)
