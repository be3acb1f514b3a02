"""A throwaway PostgreSQL server for tests: Debian's `postgresql` package (the Makefile installs
it), a fresh cluster in a temporary folder, listening on a free loopback port, stopped and removed
after. As root (CI) the server runs as the package's `postgres` user (PostgreSQL refuses root)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from triton_pipelines.server.processes import free_ports


def postgres_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise RuntimeError("PostgreSQL is not installed: `make install` installs Debian's postgresql package")
    return Path(found[-1]).parent


class PostgresServer:
    def __init__(self):
        self.bin = postgres_bin()
        self.root = Path(tempfile.mkdtemp(prefix="spend-pg-"))
        self.data = self.root / "data"
        self.port = free_ports(1)[0]
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
            os.chmod(self.root, 0o700)
        self._run([self.bin / "initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync",
                   "-E", "UTF8", "--locale", "C"])
        self.process = subprocess.Popen(
            self._command([self.bin / "postgres", "-D", self.data, "-p", str(self.port), "-k", self.root,
                           "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200"]),
            stdout=open(self.root / "server.log", "wb"), stderr=subprocess.STDOUT)
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._wait_ready()

    def _command(self, command: list) -> list[str]:
        command = [str(part) for part in command]
        return ["runuser", "-u", "postgres", "--"] + command if self.as_root else command

    def _run(self, command: list) -> None:
        subprocess.run(self._command(command), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def _wait_ready(self, timeout_s: float = 60) -> None:
        import psycopg

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("PostgreSQL did not start: " + (self.root / "server.log").read_text()[-2000:])
                time.sleep(0.2)

    def database(self, name: str) -> str:
        """A new empty database on this server; its URL."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # smart shutdown
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)
