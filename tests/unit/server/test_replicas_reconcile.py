"""The supervisor's reconcile pass (triton_pipelines.server.replicas), against fakes: no process, no server,
no sleep. The clock, the process factory and the background tasks are injected; every pass runs
with time.sleep forbidden, so a pass that waited would fail here.

What the live suites check through the public ports (tests/server/test_faults.py: a killed stub, a killed
screen, a crashed tritonserver; tests/server/test_replicas.py: retiring), these check state by state,
including what cannot be staged live: two replicas, one restarting while the other's dead stub is
repaired."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from triton_pipelines.server.replicas import Replica, ReplicaSet, ReplicaState
from triton_pipelines.server.status import LauncherMetrics
from triton_pipelines.server.tritonserver import ServerOptions

STUB = {"image_preprocess": ["image_preprocess_0_0"]}
_pids = itertools.count(1000)


class FakeClock:
    def __init__(self):
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeProcess:
    def __init__(self, name: str, ready: bool = False):
        self.name, self.pid, self.returncode, self.ready = name, next(_pids), None, ready

    def poll(self):
        return self.returncode

    def die(self, code: int = -11) -> None:
        self.returncode = code

    def send_signal(self, signum: int) -> None:
        self.die(-signum)

    def terminate(self) -> None:
        self.die(-15)

    def kill(self) -> None:
        self.die(-9)

    def wait(self, timeout=None) -> int:
        return self.returncode


class FakeWatchdog:
    """``killed``: the stubs dead right now; ``detect`` confirms them at once, ``repair`` revives them."""

    def __init__(self):
        self.killed: dict[str, list[str]] = {}
        self.dead: dict[str, list[str]] = {}
        self.leaked: set[str] = set()
        self.detects = self.repairs = self.resets = 0

    def detect(self):
        self.detects += 1
        self.dead = {model: list(instances) for model, instances in self.killed.items()}
        return self.dead

    def repair(self):
        self.repairs += 1
        repaired = sorted(self.dead)
        self.leaked |= set(repaired)
        self.killed.clear()
        self.dead.clear()
        return repaired

    def reset(self):
        self.resets += 1
        self.killed.clear()
        self.dead.clear()
        self.leaked.clear()

    def missing_now(self):
        return dict(self.killed)

    def problems(self):
        return [f"model '{m}': Python stub(s) died (reloading)" for m in sorted(self.dead or self.killed)]


class FakeMachine:
    """The process factory: every spawn is a FakeProcess; a new tritonserver is ready once a test says so."""

    def __init__(self):
        self.servers: list[FakeProcess] = []
        self.screens: list[FakeProcess] = []
        self.leftovers: list[tuple[int, str]] = []
        self.screens_listen = True  # a new screen's ports accept connections at once

    def start_server(self, replica):
        self.servers.append(FakeProcess(f"tritonserver {replica.label}"))
        return self.servers[-1]

    def start_screen(self, replica):
        self.screens.append(FakeProcess(f"screen {replica.label}", ready=self.screens_listen))
        return self.screens[-1]

    def server_ready(self, replica):
        return replica.process.poll() is None and replica.process.ready

    def screen_listening(self, replica):
        return replica.screen.ready

    def remove_leftovers(self, server_pid, shm_prefix):
        self.leftovers.append((server_pid, shm_prefix))
        return 2, 64 * 2**20

    def watchdog(self, replica):
        return FakeWatchdog()


class FakeProxy:
    def __init__(self):
        self.process = FakeProcess("nginx")
        self.restarts = 0
        self.reloads: list[tuple[tuple[int, ...], bool]] = []

    def alive(self):
        return self.process.poll() is None

    def restart(self):
        self.restarts += 1
        self.process = FakeProcess("nginx")

    def reconfigure(self, config, timeout_s=60, wait=True):
        self.reloads.append((config, wait))


class ManualTasks:
    """``submit`` for background work: nothing runs until the test says so."""

    def __init__(self):
        self.pending: list[tuple[str, object, Future]] = []

    def submit(self, function, name):
        future = Future()
        self.pending.append((name, function, future))
        return future

    def run(self) -> list[str]:
        ran = []
        while self.pending:
            name, function, future = self.pending.pop(0)
            try:
                future.set_result(function())
            except Exception as error:  # handed to the pass, as in_thread does
                future.set_exception(error)
            ran.append(name)
        return ran


class Rig:
    def __init__(self, count: int, warm=None):
        self.clock, self.machine, self.tasks, self.proxy = FakeClock(), FakeMachine(), ManualTasks(), FakeProxy()
        self.metrics, self.logs = LauncherMetrics(), []
        options = ServerOptions(model_repository=Path("repo"), replicas=count)
        self.replicas = [Replica(i, options, "k" * 20, self.machine, self.metrics, self.logs.append,
                                 clock=self.clock, submit=self.tasks.submit) for i in range(count)]
        for replica in self.replicas:
            replica.process.ready = True
            replica.wait_ready(timeout_s=1)  # the start (blocking, before supervision): ready at once here
        self.set = ReplicaSet(self.replicas, self.proxy, lambda routed: routed, self.metrics, self.logs.append,
                              threading.Event(), warm=warm)

    def states(self) -> list[ReplicaState]:
        return [r.state for r in self.replicas]

    def log(self) -> str:
        return "\n".join(self.logs)


@pytest.fixture(autouse=True)
def never_sleeps(monkeypatch):
    def forbidden(seconds):
        raise AssertionError(f"a reconcile pass slept {seconds} s")

    monkeypatch.setattr(time, "sleep", forbidden)


def test_replicas_start_ready_and_a_quiet_pass_changes_nothing():
    rig = Rig(2)
    rig.set.reconcile()
    assert rig.states() == [ReplicaState.READY, ReplicaState.READY]
    assert rig.set.routed == (0, 1) and rig.proxy.reloads == [] and rig.set.not_ready_reasons() == []
    assert [r.watchdog.detects for r in rig.replicas] == [1, 1]


def test_a_dead_stub_degrades_the_replica_until_the_watchdog_repaired_it_in_the_background():
    rig = Rig(1)
    replica = rig.replicas[0]
    replica.watchdog.killed = dict(STUB)
    assert "image_preprocess" in rig.set.not_ready_reasons()[0]  # at once, before any pass
    rig.set.reconcile()
    assert replica.state is ReplicaState.DEGRADED
    assert [name for name, _, _ in rig.tasks.pending] == ["replica-0-repair"]  # started, not waited for
    rig.set.reconcile()  # the reload is still running: nothing else is asked of this replica
    assert len(rig.tasks.pending) == 1 and replica.watchdog.detects == 1 and replica.state is ReplicaState.DEGRADED
    rig.tasks.run()
    assert replica.watchdog.repairs == 1
    rig.set.reconcile()
    assert replica.state is ReplicaState.READY and rig.set.not_ready_reasons() == []
    assert not rig.tasks.pending


def test_a_repair_that_fails_is_logged_and_tried_again():
    rig = Rig(1)
    replica = rig.replicas[0]
    replica.watchdog.killed = dict(STUB)
    replica.watchdog.repair = lambda: (_ for _ in ()).throw(ValueError("config unreadable"))
    rig.set.reconcile()
    rig.tasks.run()
    rig.set.reconcile()
    assert "repair failed: ValueError: config unreadable; will retry" in rig.log()
    assert replica.state is ReplicaState.DEGRADED and len(rig.tasks.pending) == 1  # a new attempt


def test_a_dead_tritonserver_is_restarted_without_a_pass_waiting_for_it(monkeypatch):
    monkeypatch.setenv("TRITON_READY_TIMEOUT_S", "600")
    rig = Rig(1)
    replica = rig.replicas[0]
    old = replica.process
    replica.watchdog.killed = dict(STUB)
    old.die(-11)
    rig.set.reconcile()
    # the first crash: no backoff, leftovers removed, spawned again in the same pass
    assert rig.machine.leftovers == [(old.pid, replica.shm_prefix)] and replica.process is not old
    assert replica.state is ReplicaState.STARTING and replica.watchdog.resets == 1
    assert rig.metrics.server_restarts["0"] == 1
    assert "tritonserver exited unexpectedly (signal 11); removed 2 orphaned stub(s) and 64 MiB of /dev/shm; " \
           "restarting it (restart 1)" in rig.log()
    for _ in range(3):  # loading: each pass asks once and moves on
        rig.clock.advance(1)
        rig.set.reconcile()
    assert replica.state is ReplicaState.STARTING
    assert rig.set.not_ready_reasons() == ["tritonserver is not running (restarting)"]
    replica.process.ready = True
    rig.set.reconcile()
    assert replica.state is ReplicaState.READY and "tritonserver is ready again" in rig.log()
    assert rig.set.not_ready_reasons() == []


def test_a_tritonserver_that_keeps_dying_waits_out_a_growing_backoff():
    rig = Rig(1)
    replica = rig.replicas[0]
    replica.process.die(-9)
    rig.set.reconcile()  # restart 1, at once
    first = replica.process
    rig.clock.advance(5)
    first.die(1)  # it died again within a minute of its start: 2 s backoff, then 4 s, ... up to 30 s
    rig.set.reconcile()
    assert "exited with code 1 before it was ready" in rig.log() and "restart 2, after 2 s" in rig.log()
    assert replica.state is ReplicaState.RESTARTING and replica.process is first
    rig.clock.advance(1.5)
    rig.set.reconcile()
    assert replica.state is ReplicaState.RESTARTING and len(rig.machine.servers) == 2
    rig.clock.advance(0.5)
    rig.set.reconcile()
    assert replica.state is ReplicaState.STARTING and len(rig.machine.servers) == 3
    rig.clock.advance(1)
    replica.process.die(1)
    rig.set.reconcile()
    assert "restart 3, after 4 s" in rig.log()
    rig.clock.advance(61)  # a crash long after its start is not a quick one: at once again
    rig.set.reconcile()
    replica.process.ready = True
    rig.set.reconcile()
    rig.clock.advance(61)
    replica.process.die(-11)
    rig.set.reconcile()
    assert rig.log().endswith("restarting it (restart 4)") and replica.state is ReplicaState.STARTING


def test_a_restart_that_does_not_become_ready_in_time_is_supervised_anyway(monkeypatch):
    monkeypatch.setenv("TRITON_READY_TIMEOUT_S", "30")
    rig = Rig(1)
    replica = rig.replicas[0]
    replica.process.die(-11)
    rig.set.reconcile()
    rig.clock.advance(31)
    rig.set.reconcile()
    assert "did not become ready: tritonserver was not ready after 30 s" in rig.log()
    assert replica.state is ReplicaState.READY and not replica.healthy()  # readiness follows Triton's own


def test_a_restarted_replica_is_warmed_up_before_it_is_ready_again():
    warmed = []
    rig = Rig(1, warm=warmed.append)
    replica = rig.replicas[0]
    replica.process.die(-11)
    rig.set.reconcile()
    replica.process.ready = True
    rig.set.reconcile()
    assert replica.state is ReplicaState.STARTING and [n for n, _, _ in rig.tasks.pending] == ["replica-0-warm-up"]
    assert rig.set.not_ready_reasons() == ["tritonserver is warming its pipelines up (restarted)"]
    rig.tasks.run()
    rig.set.reconcile()
    assert warmed == [replica] and replica.state is ReplicaState.READY


def test_a_failed_warm_up_is_logged_and_the_replica_serves_without_it():
    def warm(replica):
        raise ConnectionError("refused")

    rig = Rig(1, warm=warm)
    replica = rig.replicas[0]
    replica.process.die(-11)
    rig.set.reconcile()
    replica.process.ready = True
    rig.set.reconcile()
    rig.tasks.run()
    rig.set.reconcile()
    assert replica.state is ReplicaState.READY
    assert "pipeline warm-up failed, serving without it: ConnectionError: refused" in rig.log()


def test_a_dead_nginx_is_restarted_and_counted():
    rig = Rig(1)
    rig.proxy.process.die(1)
    rig.set.reconcile()
    assert rig.proxy.restarts == 1 and rig.metrics.proxy_restarts == 1 and rig.proxy.alive()
    assert "nginx exited with code 1; restarting it" in rig.log()
    assert rig.states() == [ReplicaState.READY]


def test_a_restarted_request_screen_counts_once_it_listens():
    """Readiness must not say yes while nginx would find no screen to send a request to."""
    rig = Rig(1)
    replica = rig.replicas[0]
    replica.screen.die(-9)
    assert rig.set.not_ready_reasons() == ["the request screen is not running (restarting)"]
    rig.machine.screens_listen = False
    rig.set.reconcile()
    assert rig.metrics.screen_restarts == 1 and replica.screen_alive() and not replica.healthy()
    assert rig.set.not_ready_reasons() == ["the request screen is starting"]
    replica.screen.ready = True  # it listens now
    assert replica.healthy() and rig.set.not_ready_reasons() == []


def test_a_dead_request_screen_is_restarted_whatever_the_replica_is_doing():
    rig = Rig(1)
    replica = rig.replicas[0]
    replica.process.die(-11)
    rig.set.reconcile()  # STARTING now
    old = replica.screen
    old.die(-9)
    rig.set.reconcile()
    assert replica.screen is not old and replica.screen_alive() and rig.metrics.screen_restarts == 1
    assert "the request screen exited with code -9; restarting it" in rig.log()


def test_two_replicas_one_restarts_while_the_other_serves_and_its_dead_stub_is_repaired():
    rig = Rig(2)
    serving, crashed = rig.replicas
    crashed.process.die(-11)
    rig.set.reconcile()
    assert rig.states() == [ReplicaState.READY, ReplicaState.STARTING]
    assert rig.set.routed == (0,) and rig.proxy.reloads[-1] == ((0,), False)  # nginx's reload not waited for
    assert rig.set.not_ready_reasons() == []  # replica 0 serves
    detects = serving.watchdog.detects
    rig.clock.advance(1)
    serving.watchdog.killed = dict(STUB)  # while replica 1 loads, a stub of replica 0 dies
    rig.set.reconcile()
    assert serving.watchdog.detects == detects + 1  # still watched
    assert rig.states() == [ReplicaState.DEGRADED, ReplicaState.STARTING]
    assert rig.set.routed == (0, 1)  # none is healthy: every replica in service keeps its share
    assert rig.set.not_ready_reasons() == [
        "replica 0: model 'image_preprocess': Python stub(s) died (reloading)",
        "replica 1: tritonserver is not running (restarting)"]
    assert [n for n, _, _ in rig.tasks.pending] == ["replica-0-repair"]
    rig.tasks.run()
    rig.clock.advance(1)
    rig.set.reconcile()
    assert serving.watchdog.repairs == 1
    assert rig.states() == [ReplicaState.READY, ReplicaState.STARTING] and rig.set.routed == (0,)
    crashed.process.ready = True
    rig.clock.advance(1)
    rig.set.reconcile()
    assert rig.states() == [ReplicaState.READY, ReplicaState.READY] and rig.set.routed == (0, 1)
    assert "tritonserver (replica 1) exited unexpectedly (signal 11)" in rig.log()
    assert "routing to replica(s) 0, 1" in rig.log()
    assert dict(rig.metrics.server_restarts) == {"1": 1}


def test_a_pass_does_not_wait_for_routing_a_retire_holds():
    rig = Rig(2)
    rig.replicas[1].process.die(-11)
    with rig.set._routing:  # a retire request is reloading nginx and waiting for its old workers
        rig.set.reconcile()
    assert rig.set.routed == (0, 1) and rig.proxy.reloads == []  # skipped, not waited for
    rig.set.reconcile()
    assert rig.set.routed == (0,)


def test_a_retired_replica_is_left_alone():
    rig = Rig(2)
    retired = rig.replicas[1]
    retired.retire()
    retired.process.die(-15)
    retired.screen.die(-15)
    rig.set.reconcile()
    assert retired.state is ReplicaState.RETIRED and len(rig.machine.servers) == 2 and len(rig.machine.screens) == 2
    assert not rig.machine.leftovers and rig.set.not_ready_reasons() == []


def test_nothing_moves_once_the_launcher_is_stopping():
    rig = Rig(1)
    rig.set.stopping.set()
    rig.replicas[0].process.die(-15)
    rig.proxy.process.die(0)
    rig.set.reconcile()
    assert rig.proxy.restarts == 0 and len(rig.machine.servers) == 1 and rig.states() == [ReplicaState.READY]
