"""Watching a rollout on the server: a step's hold (the gate judged on the metrics), a drain (no more
requests for the old versions), an unload (their instances gone). The ``Rollout`` façade
(``rollout.py``) runs these for its ``Hold``, ``WaitDrained`` and ``WaitUnloaded`` actions."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from triton_pipelines.ops.rollout_plan import Family, Gate, Metrics, StepReport, judge, measure, served
from triton_pipelines.server.control import ControlClient


@dataclass
class RolloutWatch:
    """The server watched for a model's family while a rollout waits (metrics, then model states)."""

    control: ControlClient
    metrics_url: str
    family: Family
    log: Callable[[str], None]
    poll_s: float
    # drain: the old version must see no new request for this long (and nothing pending)
    quiet_s: float
    drain_timeout_s: float
    unload_timeout_s: float

    def wait_drained(self, versions: set[int]) -> None:
        """Until the versions got no request for ``quiet_s`` and nothing is pending on them."""
        deadline = time.monotonic() + self.drain_timeout_s
        last, quiet_since = None, time.monotonic()
        while True:
            metrics = Metrics.scrape(self.metrics_url)
            served_now = served(metrics, self.family, versions)
            pending = metrics.total("nv_inference_pending_request_count", model=self.family.members,
                                    version=[str(v) for v in versions])
            if served_now != last or pending:
                last, quiet_since = served_now, time.monotonic()
            elif time.monotonic() - quiet_since >= self.quiet_s:
                return
            if time.monotonic() > deadline:
                self.log(f"version(s) {sorted(versions)} still get requests after {self.drain_timeout_s:g} s "
                         f"(callers naming the version?); retiring anyway: requests in flight still finish")
                return
            time.sleep(min(self.poll_s, self.quiet_s / 2))

    def wait_unloaded(self, versions: set[int]) -> None:
        deadline = time.monotonic() + self.unload_timeout_s
        while time.monotonic() < deadline:
            busy = [(e["name"], e.get("version")) for e in self.control.index()
                    if e.get("name") in self.family.members and e.get("version")
                    and int(e["version"]) in versions and e.get("state") in ("READY", "UNLOADING")]
            if not busy:
                return
            time.sleep(0.2)
        self.log(f"version(s) {sorted(versions)} are still unloading after {self.unload_timeout_s:g} s")

    def hold(self, share: float, target: int, sources: set[int], hold_s: float, gate: Gate) -> StepReport:
        """Watch a step for ``hold_s``; ends early on a breach."""
        report = StepReport(share)
        start = Metrics.scrape(self.metrics_url)
        ends = time.monotonic() + hold_s
        while True:
            time.sleep(max(0.0, min(self.poll_s, ends - time.monotonic())))
            report = measure(start, Metrics.scrape(self.metrics_url), self.family, share, target, sources)
            report.breach = judge(gate, report)
            if report.breach or time.monotonic() >= ends:
                return report
