"""The tritonservers behind the one nginx, each a state machine, all advanced by one pass that never
waits: ``ReplicaSet.reconcile()``, which the launcher's supervision thread calls every tick.

A ``Replica`` is one tritonserver on loopback ports of its own, its request screen
(``screen_server.py``) and its stub watchdog (``stub_watchdog.py``). Its ``ReplicaState``:

- ``STARTING``: tritonserver spawned; each pass asks Triton whether it is ready (one short probe,
  no waiting). Ready → warm-up (in a thread of its own, when the launcher warms pipelines) →
  READY. Exits first → RESTARTING. Past the start-up limit (``ready_timeout_s``) it is logged and
  supervised as READY anyway: readiness then follows Triton's own, as before the limit.
- ``READY``: in service. Each pass the watchdog looks for dead Python stubs (``detect``).
- ``DEGRADED``: in service, but a Python stub died: nginx routes around it while the watchdog
  reloads the model (``repair``, in a thread of its own); READY again once no stub is dead.
- ``RESTARTING``: tritonserver exited unexpectedly; its orphaned stubs and shared memory were
  removed; spawned again (→ STARTING) once the backoff deadline (from the injected clock) passes.
  The backoff grows for a server that keeps dying within a minute of its start (up to 30 s).
- ``RETIRED``: taken out of service (``ReplicaSet.retire``): nothing changes it again.

One pass (``ReplicaSet.reconcile``): nginx dead → restarted; then for each replica in service, a
dead request screen → restarted, and its state advanced as above; then nginx routes to the healthy
replicas (all of them if none is) with a graceful reload it does not wait for; then a repair starts
for each DEGRADED replica that has none running. A replica is healthy (routed, and ready for
``/v2/health/ready``) when it is in service, running, Triton is ready, no stub is dead as of a
/proc scan at that moment, and its screen runs and listens. Every step is a process poll, a /proc scan, a
spawn or one short HTTP call: the waits (backoff, start-up, a model reload, warm-up) are deadlines
checked on later passes or threads whose end a later pass notices, so one replica's restart never
stops the others' watching, nginx's, or routing.

The outside world is injected: the clock, the process factory (``ReplicaProcesses``: spawn the
server and the screen, probe Triton's readiness and the screen's ports, remove leftovers, make
the watchdog) and how a background
task runs (``submit``), so ``tests/unit/server/test_replicas_reconcile.py`` runs passes against fakes.
"""

from __future__ import annotations

import enum
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any, Callable, Protocol

from triton_pipelines.cancel_board import BOARD_ENV, CancelBoard
from triton_pipelines.server.control import ControlClient
from triton_pipelines.server.drain import drain
from triton_pipelines.server.processes import free_ports, remove_leftovers, spawn
from triton_pipelines.gateway.ledger_db import DATABASE_ENV
from triton_pipelines.server.status import LauncherMetrics
from triton_pipelines.server.stub_watchdog import StubWatchdog
from triton_pipelines.server.tritonserver import (LOOPBACK, InternalPorts, ServerOptions, ready_timeout_s,
                                                 request_bytes_flags, server_command, server_environment)

# How long a tritonserver must have run for its exit not to count as a quick crash (backoff).
QUICK_CRASH_S = 60.0
MAX_BACKOFF_S = 30.0


class ReplicaState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DEGRADED = "degraded"
    RESTARTING = "restarting"
    RETIRED = "retired"


IN_SERVICE = (ReplicaState.READY, ReplicaState.DEGRADED)  # watched by the stub watchdog, routable


class Process(Protocol):
    """What a replica uses of a ``subprocess.Popen``."""
    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def send_signal(self, signum: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


class ReplicaProcesses(Protocol):
    """A replica's reach into the machine (``TritonProcesses``; fakes in the tests)."""

    def start_server(self, replica: "Replica") -> Process: ...
    def start_screen(self, replica: "Replica") -> Process: ...
    def server_ready(self, replica: "Replica") -> bool: ...
    def screen_listening(self, replica: "Replica") -> bool: ...
    def remove_leftovers(self, server_pid: int, shm_prefix: str) -> tuple[int, int]: ...
    def watchdog(self, replica: "Replica") -> StubWatchdog: ...


Submit = Callable[[Callable[[], Any], str], Future]


def in_thread(function: Callable[[], Any], name: str) -> Future:
    """Run ``function`` in a daemon thread of its own; its end (or error) is the future's."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function())
        except BaseException as error:  # handed to whoever looks at the future
            future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class TritonProcesses:
    """The real ``ReplicaProcesses``: tritonserver and the screen as children that die with the
    launcher (``processes.spawn``), in sessions of their own (a terminal's Ctrl-C reaches the
    launcher, which drains, not tritonserver, whose own shutdown fails in-flight ensembles)."""

    def __init__(self, options: ServerOptions, key: str, metrics: LauncherMetrics, log: Callable[[str], None],
                 stdout=None, stderr=None, public_models: Path | None = None, board: CancelBoard | None = None):
        self.options, self.key, self.metrics, self.log = options, key, metrics, log
        self.stdout, self.stderr = stdout, stderr
        self.public_models = public_models
        self.board = board  # the screens mark requests whose client has gone; the stubs look (cancel_board.py)

    def start_server(self, replica: "Replica") -> subprocess.Popen:
        embedded = self.options.tritonserver is None
        env = server_environment() if embedded else dict(os.environ)
        if self.options.spend_database_url:
            env[DATABASE_ENV] = self.options.spend_database_url
        if self.board is not None:
            env[BOARD_ENV] = str(self.board.folder)
        return spawn(server_command(self.options, replica.internal, self.key, replica.shm_prefix),
                     env=env, stdout=self.stdout, stderr=self.stderr, start_new_session=True)

    def start_screen(self, replica: "Replica") -> subprocess.Popen:
        """The replica's request screen (screen_server.py): nginx sends it every inference request."""
        command = [sys.executable, "-m", "triton_pipelines", "screen",
                   f"--http-port={replica.screen_ports[0]}", f"--grpc-port={replica.screen_ports[1]}",
                   f"--triton-http={LOOPBACK}:{replica.internal.http}",
                   f"--triton-grpc={LOOPBACK}:{replica.internal.grpc}",
                   f"--max-body-bytes={self.options.max_body_bytes}",
                   # the gRPC port's places are counted in the screens: this replica's part of them
                   f"--max-inflight={self.options.max_inflight}", f"--replicas={self.options.replicas}",
                   f"--replica-index={replica.index}"]
        if self.options.max_inflight_per_client is not None:
            command.append(f"--max-inflight-per-client={self.options.max_inflight_per_client}")
        command += request_bytes_flags(self.options)
        if self.public_models is not None:
            command.append(f"--public-models-file={self.public_models}")
        if self.board is not None:
            command.append(f"--cancel-board={self.board.folder}")
        return spawn(command, stdout=self.stdout, stderr=self.stderr, start_new_session=True)

    def server_ready(self, replica: "Replica") -> bool:
        try:
            with urllib.request.urlopen(f"http://{replica.control.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def screen_listening(self, replica: "Replica") -> bool:
        """The screen opens its HTTP port, then its gRPC port: a connection to the latter says both listen."""
        try:
            socket.create_connection((LOOPBACK, replica.screen_ports[1]), timeout=0.5).close()
            return True
        except OSError:
            return False

    def remove_leftovers(self, server_pid: int, shm_prefix: str) -> tuple[int, int]:
        return remove_leftovers(server_pid, shm_prefix)

    def watchdog(self, replica: "Replica") -> StubWatchdog:
        return StubWatchdog(replica.control, lambda: replica.process.pid, self.metrics, self.log,
                            replica=replica.label)


class Replica:
    """One tritonserver, its request screen and its stub watchdog, with a ``ReplicaState``
    (module docstring). ``reconcile`` advances it one step at a time and never waits."""

    def __init__(self, index: int, options: ServerOptions, key: str, processes: ReplicaProcesses,
                 metrics: LauncherMetrics, log: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 submit: Submit = in_thread):
        self.index, self.label = index, str(index)
        self.options, self.processes, self.metrics, self.log = options, processes, metrics, log
        self.clock, self.submit = clock, submit
        self.internal = InternalPorts(*free_ports(3))
        self.screen_ports = tuple(free_ports(2))  # (HTTP, gRPC) of this replica's request screen
        self.shm_prefix = f"triton_pipelines_{os.getpid()}_{self.internal.http}_"
        self.control = ControlClient(f"{LOOPBACK}:{self.internal.http}", key)
        self.watchdog = processes.watchdog(self)
        self.state = ReplicaState.STARTING
        self._state_lock = threading.Lock()  # RETIRED (a retire request's thread) is final
        self.quick_crashes = 0
        self.restarted = False  # tritonserver was restarted at least once
        self.restart_at = 0.0  # RESTARTING: when to spawn it again
        self.ready_by: float | None = None  # STARTING after a restart: the start-up limit
        self.task: Future | None = None  # a repair or a warm-up in flight
        self.task_name = ""
        self.started_at = clock()
        self.process = processes.start_server(self)
        self.screen = processes.start_screen(self)
        self.screen_listens = False  # once its ports accept connections (a new screen takes a moment)

    # ------------------------------------------------------------------------- looking
    @property
    def retired(self) -> bool:
        return self.state is ReplicaState.RETIRED

    def _which(self) -> str:
        return f" (replica {self.label})" if self.options.replicas > 1 else ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def screen_alive(self) -> bool:
        return self.screen.poll() is None

    def screen_up(self) -> bool:
        """Its request screen runs and listens (probed until it does once, then only polled)."""
        if not self.screen_alive():
            return False
        if not self.screen_listens:
            self.screen_listens = self.processes.screen_listening(self)
        return self.screen_listens

    def triton_ready(self) -> bool:
        return self.processes.server_ready(self)

    def healthy(self) -> bool:
        """Fit to be sent requests: in service, running, ready, every Python stub alive (as of now, not
        only as of the watchdog's last pass)."""
        return (self.state in IN_SERVICE and self.alive() and self.screen_up() and not self.watchdog.dead
                and not self.watchdog.missing_now() and self.triton_ready())

    def problems(self) -> list[str]:
        """Why it cannot serve (for readiness answers)."""
        if self.state is ReplicaState.STARTING and self.task is not None:
            return ["tritonserver is warming its pipelines up (restarted)"]
        if (self.state is ReplicaState.RESTARTING or (self.state is ReplicaState.STARTING and self.restarted)
                or not self.alive()):
            return ["tritonserver is not running (restarting)"]
        problems = self.watchdog.problems()
        if not self.screen_alive():
            problems.append("the request screen is not running (restarting)")
        elif not self.screen_up():
            problems.append("the request screen is starting")
        if not self.triton_ready():
            problems.append("tritonserver is not ready (models loading or unloading)")
        return problems

    # ------------------------------------------------------------------------- state
    def _set(self, state: ReplicaState) -> None:
        with self._state_lock:
            if self.state is not ReplicaState.RETIRED:
                self.state = state

    def retire(self) -> None:
        with self._state_lock:
            self.state = ReplicaState.RETIRED

    def wait_ready(self, timeout_s: float) -> None:
        """The start: block until Triton is ready (raises if it exits first or takes too long), then
        READY. Supervision starts after this; it never waits like this."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready")
            if self.triton_ready():
                self._set(ReplicaState.READY)
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver was not ready after {timeout_s:.0f} s")

    # ------------------------------------------------------------------------- one pass
    def reconcile(self, stopping: threading.Event, warm: Callable[["Replica"], Any] | None = None) -> None:
        """Advance this replica one step (module docstring); returns at once."""
        if self.retired or stopping.is_set():
            return
        if not self.screen_alive():
            self.restart_screen()
        if self.task is not None:
            if not self.task.done():
                return  # a repair or warm-up runs; a dead server ends it soon, and is seen then
            self._task_ended()
        now = self.clock()
        if self.state in IN_SERVICE and not self.alive():
            self._crashed(now)
        if self.state is ReplicaState.STARTING:
            self._poll_start(now, warm)
        if self.state is ReplicaState.RESTARTING and now >= self.restart_at:
            self._spawn(now)
        elif self.state in IN_SERVICE and self.task is None:
            self._watch(stopping)

    def restart_screen(self) -> None:
        self.log(f"the request screen{self._which()} exited with code {self.screen.returncode}; restarting it")
        with self.metrics.lock:
            self.metrics.screen_restarts += 1
        self.screen_listens = False
        self.screen = self.processes.start_screen(self)

    def _crashed(self, now: float) -> None:
        """tritonserver exited unexpectedly: remove what it left → RESTARTING, with a backoff if it keeps dying."""
        code = self.process.returncode or 0
        how = f"signal {-code}" if code < 0 else f"code {code}"
        killed, freed = self.processes.remove_leftovers(self.process.pid, self.shm_prefix)
        self.quick_crashes = self.quick_crashes + 1 if now - self.started_at < QUICK_CRASH_S else 1
        with self.metrics.lock:
            self.metrics.server_restarts[self.label] += 1
            restarts = self.metrics.server_restarts[self.label]
        backoff = min(MAX_BACKOFF_S, 2.0 ** (self.quick_crashes - 1)) if self.quick_crashes > 1 else 0.0
        self.log(f"tritonserver{self._which()} exited unexpectedly ({how}); removed {killed} orphaned stub(s) and "
                 f"{freed / 2**20:.0f} MiB of /dev/shm; restarting it (restart {restarts}"
                 + (f", after {backoff:.0f} s" if backoff else "") + ")")
        self.watchdog.reset()
        self.restarted = True
        self.restart_at = now + backoff
        self._set(ReplicaState.RESTARTING)

    def _spawn(self, now: float) -> None:
        self.started_at = now
        self.process = self.processes.start_server(self)
        self.ready_by = now + ready_timeout_s()
        self._set(ReplicaState.STARTING)

    def _poll_start(self, now: float, warm: Callable[["Replica"], Any] | None) -> None:
        if not self.alive():
            self.log(f"restarted tritonserver{self._which()} did not become ready: tritonserver exited with code "
                     f"{self.process.returncode} before it was ready")
            self._crashed(now)
        elif self.triton_ready():
            self.log(f"tritonserver{self._which()} is ready" + (" again" if self.restarted else ""))
            self.ready_by = None
            if warm is None:
                self._set(ReplicaState.READY)
            else:
                self._start_task("warm-up", lambda: warm(self))
        elif self.ready_by is not None and now >= self.ready_by:
            self.log(f"restarted tritonserver{self._which()} did not become ready: tritonserver was not ready "
                     f"after {ready_timeout_s():.0f} s")
            self.ready_by = None
            self._set(ReplicaState.READY)  # supervised; readiness follows Triton's own

    def _watch(self, stopping: threading.Event) -> None:
        try:
            self.watchdog.detect()
        except (urllib.error.URLError, OSError, ValueError) as error:
            if not stopping.is_set() and self.alive():
                self.log(f"watchdog check failed: {error}")
            return
        self._set(ReplicaState.DEGRADED if self.watchdog.dead else ReplicaState.READY)

    def start_repair(self) -> None:
        """DEGRADED: reload the models whose stubs died, in a thread (a reload takes seconds)."""
        if self.state is ReplicaState.DEGRADED and self.task is None and self.watchdog.dead:
            self._start_task("repair", self.watchdog.repair)

    def _start_task(self, name: str, function: Callable[[], Any]) -> None:
        self.task_name = name
        self.task = self.submit(function, f"replica-{self.label}-{name}")

    def _task_ended(self) -> None:
        task, self.task = self.task, None
        error = task.exception() if task is not None else None
        if self.task_name == "warm-up":
            if error is not None:
                self.log(f"pipeline warm-up{self._which()} failed, serving without it: "
                         f"{type(error).__name__}: {error}")
            if self.state is ReplicaState.STARTING:
                self._set(ReplicaState.READY)
        elif error is not None:
            self.log(f"watchdog: repair{self._which()} failed: {type(error).__name__}: {error}; will retry")
        # after a repair the next detect says whether it is READY again

    def wait_task(self, timeout_s: float) -> None:
        if self.task is not None:
            wait_futures([self.task], timeout=timeout_s)

    # ------------------------------------------------------------------------- stop
    def stop(self, timeout_s: float | None = None) -> None:
        """Drain (unload models top-down, in-flight requests finish), then SIGTERM."""
        self.wait_task(self.options.exit_timeout_secs + 60)
        if self.alive():
            leaked = set(self.watchdog.leaked)
            try:
                drain(self.control, timeout_s=self.options.exit_timeout_secs, never_unloads=leaked)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, RuntimeError) as error:
                self.log(f"drain skipped: {error}")
            # Nothing is routed here any more: the screen's idle keep-alive connections would only
            # make Triton wait out its exit timeout for them ("Found 1 HTTP service connections").
            self._stop_screen()
            self.process.send_signal(signal.SIGTERM)
            # Drained, nothing is in flight: Triton would only wait its exit timeout for an instance
            # it never releases (a model whose stub died), so that wait is cut short.
            wait_s = 5 if leaked else (timeout_s or self.options.exit_timeout_secs + 30)
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                if leaked:
                    self.log(f"stopping without waiting for the dead-stub instances of {sorted(leaked)}")
                self.process.kill()
                self.process.wait()
        self.processes.remove_leftovers(self.process.pid, self.shm_prefix)
        self._stop_screen()

    def _stop_screen(self) -> None:
        if self.screen_alive():
            self.screen.terminate()
            try:
                self.screen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.screen.kill()
                self.screen.wait()


class Proxy(Protocol):
    """What the replica set uses of ``nginx_process.ProxyProcess`` (nginx)."""
    process: Process

    def alive(self) -> bool: ...
    def restart(self) -> None: ...
    def reconfigure(self, config: Any, timeout_s: float = 60, wait: bool = True) -> None: ...


class ReplicaSet:
    """The replicas behind the one nginx: one ``reconcile`` pass per supervision tick, routing,
    retire and readiness."""

    def __init__(self, replicas: list[Replica], proxy: Proxy, proxy_config: Callable[[tuple[int, ...]], Any],
                 metrics: LauncherMetrics, log: Callable[[str], None], stopping: threading.Event,
                 warm: Callable[[Replica], Any] | None = None, frontend: Any = None):
        self.replicas = replicas
        # A process beside the replicas that the pass keeps running (the OpenAI-compatible frontend:
        # openai_process.FrontendProcess; its ensure_running() restarts it with a backoff, never waits).
        self.frontend = frontend
        self.proxy, self.proxy_config = proxy, proxy_config
        self.metrics, self.log, self.stopping, self.warm = metrics, log, stopping, warm
        self.routed: tuple[int, ...] = tuple(r.index for r in replicas)
        self._routing = threading.Lock()  # the reconcile pass and a retire request both reroute

    def in_service(self) -> list[Replica]:
        return [r for r in self.replicas if not r.retired]

    def reconcile(self) -> None:
        """One pass over nginx, every replica and the routing; never waits (module docstring)."""
        if self.stopping.is_set():
            return
        if not self.proxy.alive():
            self.log(f"nginx exited with code {self.proxy.process.returncode}; restarting it")
            with self.metrics.lock:
                self.metrics.proxy_restarts += 1
            self.proxy.restart()
        if self.frontend is not None:
            self.frontend.ensure_running()
        for replica in self.in_service():
            replica.reconcile(self.stopping, self.warm)
        if self.stopping.is_set():
            return
        self.route(wait=False)  # route around a dead stub before repairing it
        for replica in self.in_service():
            replica.start_repair()

    def route(self, wait: bool = True) -> bool:
        """Send requests only to healthy replicas (all of them if none is). ``wait=False``: skip it
        while a retire holds the routing, and do not wait for nginx's old workers."""
        if not self._routing.acquire(blocking=wait):
            return False
        try:
            active = self.in_service()
            healthy = tuple(r.index for r in active if r.healthy()) or tuple(r.index for r in active)
            if healthy and healthy != self.routed:
                self.proxy.reconfigure(self.proxy_config(healthy), wait=wait)
                if len(self.replicas) > 1:
                    self.log(f"routing to replica(s) {', '.join(str(i) for i in healthy)}")
                self.routed = healthy
            return True
        finally:
            self._routing.release()

    def retire(self, index: int) -> str:
        """Take replica ``index`` out of service without failing a request: nginx stops sending it
        requests (graceful reload, waited for), then it drains and stops."""
        if not 0 <= index < len(self.replicas) or self.replicas[index].retired:
            raise ValueError(f"no replica {index} in service")
        if all(r.retired for r in self.replicas if r.index != index):
            raise ValueError("the last replica in service cannot be retired: stop the launcher instead")
        replica = self.replicas[index]
        with self._routing:
            replica.retire()
            self.routed = tuple(i for i in self.routed if i != index) or tuple(r.index for r in self.in_service())
            self.proxy.reconfigure(self.proxy_config(self.routed))
        self.log(f"replica {index} retired from service; draining it")
        replica.stop()
        self.metrics.set_ready(replica.label, {})
        self.log(f"replica {index} stopped")
        return str(index)

    def not_ready_reasons(self) -> list[str]:
        """Why the server cannot serve: empty when some replica in service is healthy."""
        active = self.in_service()
        if any(r.healthy() for r in active):
            return []
        reasons = []
        for replica in active:
            prefix = f"replica {replica.label}: " if len(self.replicas) > 1 else ""
            reasons += [prefix + problem for problem in replica.problems()]
        return reasons or ["no replica in service"]

    def wait_tasks(self, timeout_s: float) -> None:
        """At the stop: let repairs and warm-ups in flight end (a drain must not race a reload)."""
        deadline = time.monotonic() + timeout_s
        for replica in self.replicas:
            replica.wait_task(max(0.0, deadline - time.monotonic()))
