"""The rollout's plan without a server (triton_pipelines/ops/rollout_plan.py): the ordering rule (a
version is loaded and warmed before the router's split gives it traffic, old versions are retired
only after the split took all traffic from them and their requests drained), the shares of each
step, one hold's numbers, and the rollback path on a breach run by the executor against a fake
server. tests/unit/ops/test_rollout.py runs the same moves against a real one."""

from __future__ import annotations

import pytest

from triton_pipelines.ops.rollout import Breach, Rollout
from triton_pipelines.ops.rollout_plan import (Family, Gate, Hold, LoadEnsembles, LoadVersions, Metrics, Pin, Retire,
                                           RolloutError, Settle, StepReport, WaitDrained, WaitUnloaded, Warm,
                                           WriteSplit, check_steps, measure, plan_move, rollback_version)

# Moves from several states: (loaded, current, split, target, steps, hold_s).
MOVES = [
    ({1, 2}, 1, {1: 90.0, 2: 10.0}, 2, (10, 50, 100), 60.0),  # the built canary state, rolled out
    ({1}, 1, {1: 100.0}, 2, (10, 50, 100), 60.0),  # version 2 not loaded yet
    ({2}, 2, {2: 100.0}, 1, (100,), 0.0),  # a rollback
    ({1, 2}, 1, {1: 50.0, 2: 50.0}, 1, (50, 100), 5.0),  # back to version 1 in steps
    ({1, 2, 3}, 2, {1: 60.0, 2: 30.0, 3: 10.0}, 3, (25, 100), 1.0),  # three versions
    ({1}, 1, {1: 100.0}, 1, (100,), 0.0),  # nothing to move
]


def first(actions, kind, where=lambda a: True) -> int:
    return next(i for i, a in enumerate(actions) if isinstance(a, kind) and where(a))


def indexes(actions, kind, where=lambda a: True) -> list[int]:
    return [i for i, a in enumerate(actions) if isinstance(a, kind) and where(a)]


@pytest.mark.parametrize("loaded, current, split, target, steps, hold_s", MOVES)
def test_the_ordering_rule(loaded, current, split, target, steps, hold_s):
    actions = plan_move(loaded, current, split, target, steps, hold_s)
    sources = ({v for v, s in split.items() if s > 0} | {current}) - {target}
    gives_target = first(actions, WriteSplit, lambda a: a.as_dict().get(target, 0) > 0)
    # loaded (if it was not), its ensembles loaded and warmed before any traffic goes to it
    loads = indexes(actions, LoadVersions)
    assert loads == ([] if target in loaded else [0])
    assert all(target in actions[i].versions and loaded <= actions[i].versions for i in loads)
    assert max(loads + [first(actions, LoadEnsembles), first(actions, Warm)]) < gives_target
    # the plain ensembles: first when moving to version 1, last (after every split) otherwise
    (pin,) = indexes(actions, Pin)
    assert actions[pin].version == target
    assert (pin < gives_target) if target == 1 else (pin > max(indexes(actions, WriteSplit)))
    # old versions retired only after the split left them, their callers were re-pinned and drained
    retires = indexes(actions, Retire)
    if sources:
        (retire,) = retires
        assert actions[retire].versions == sources and actions[retire].keep == target
        with_sources = indexes(actions, WriteSplit, lambda a: any(a.as_dict().get(v, 0) > 0 for v in sources))
        last_with_sources = max(with_sources, default=-1)
        assert last_with_sources < first(actions, WaitDrained) < retire < first(actions, WaitUnloaded)
        assert pin < retire
    else:
        assert not retires and not indexes(actions, WaitDrained)
    assert actions[-1] == Settle(target)
    # each step is written, then held (unless hold_s is 0)
    shares = [actions[i].as_dict()[target] for i in indexes(actions, WriteSplit)]
    assert shares == list(steps)
    holds = [actions[i] for i in indexes(actions, Hold)]
    assert [h.share for h in holds] == (list(steps) if hold_s > 0 else [])
    assert all(h.rollback_to == rollback_version(current, sources) and h.sources == sources for h in holds)


def test_traffic_leaves_the_sources_in_their_shares():
    actions = plan_move({1, 2, 3}, 2, {1: 60.0, 2: 30.0, 3: 10.0}, 3, (25, 100), hold_s=0)
    splits = [a.as_dict() for a in actions if isinstance(a, WriteSplit)]
    assert splits[0] == pytest.approx({3: 25.0, 1: 50.0, 2: 25.0})
    assert splits[1] == pytest.approx({3: 100.0, 1: 0.0, 2: 0.0})
    # sources without a share (the plain ensembles' version alone) share equally
    actions = plan_move({1, 2}, 1, {2: 100.0}, 2, (50, 100), 0)
    assert actions[first(actions, WriteSplit)] == WriteSplit(((2, 50.0), (1, 50.0)))


def test_rollback_goes_to_the_plain_ensembles_version_or_the_newest_source():
    assert rollback_version(1, {1, 3}) == 1
    assert rollback_version(2, {1, 3}) == 3
    assert rollback_version(2, set()) == 2


@pytest.mark.parametrize("steps", [(), (10, 50), (50, 10, 100), (0, 100), (100, 150)])
def test_steps_must_rise_to_100(steps):
    with pytest.raises(RolloutError, match="steps must rise to 100"):
        plan_move({1}, 1, {1: 100.0}, 2, steps)
    assert check_steps([10, "50", 100.0]) == [10.0, 50.0, 100.0]


FAMILY = Family("enc", ("enc", "enc_batch"), {"embed": "enc", "embed_batch": "enc_batch"},
                {2: ("embed_batch_v2", "embed_v2")}, ("text_embedding",), (1, 2))


def scrape(**values) -> Metrics:
    lines = [f"{name}{{{labels}}} {value}" for (name, labels), value in values.items()]
    return Metrics.parse("\n".join(lines) + "\n")


def test_measure_counts_the_family_and_the_canary_tasks_and_leaves_client_errors_out():
    before = Metrics.parse(
        'router_requests_total{task="text_embedding"} 100\n'
        'router_failures_total{task="text_embedding",reason="invalid_input"} 5\n'
        'nv_inference_request_success{model="enc",version="2"} 10\n'
        'nv_inference_request_success{model="embed_v2",version="1"} 10\n')
    after = Metrics.parse(
        'router_requests_total{task="text_embedding"} 160\n'
        'router_requests_total{task="other"} 999\n'
        'router_failures_total{task="text_embedding",reason="invalid_input"} 9\n'
        'router_failures_total{task="text_embedding",reason="upstream_unavailable"} 1\n'
        'nv_inference_request_success{model="enc",version="2"} 40\n'
        'nv_inference_request_failure{model="enc_batch",version="2"} 2\n'
        'nv_inference_request_success{model="embed_v2",version="1"} 30\n'
        'nv_inference_request_failure{model="embed",version="1"} 1\n'
        'nv_inference_request_summary_us{model="enc",version="2",quantile="0.99"} 12000\n'
        'nv_inference_request_summary_us{model="enc_batch",version="2",quantile="0.99"} NaN\n'
        'nv_inference_request_summary_us{model="enc",version="1",quantile="0.99"} 8000\n')
    report = measure(before, after, FAMILY, 50, target=2, sources={1})
    assert report == StepReport(50, requests=60 + 20 + 1, failures=1 + 1 + 2, target_requests=30 + 2, p99_ms=12.0,
                                old_p99_ms=8.0)
    assert measure(after, after, FAMILY, 50, 3, {1}).p99_ms is None


class FakeServer(Rollout):
    """The executor against a server that is only a state: versions loaded, the pin, the split.
    Holds breach at ``breach_at`` percent."""

    def __post_init__(self):
        self.family = FAMILY
        self.state = {"loaded": {1, 2}, "current": 1, "split": {1: 90.0, 2: 10.0}}
        self.actions, self.breach_at = [], None

    def _check_target(self, version):
        pass

    def loaded_versions(self):
        return set(self.state["loaded"])

    def current_version(self):
        return self.state["current"]

    def split(self):
        return dict(self.state["split"])

    def run(self, action, gate=Gate()):
        self.actions.append(action)
        if isinstance(action, (LoadVersions, Retire)):
            self.state["loaded"] = (set(action.versions) if isinstance(action, LoadVersions)
                                    else (self.state["loaded"] | {action.keep}) - action.versions)
        elif isinstance(action, Pin):
            self.state["current"] = action.version
        elif isinstance(action, WriteSplit):
            self.state["split"] = {v: s for v, s in action.shares if s > 0}
        elif isinstance(action, Settle):
            self.state["split"] = {action.version: 100.0}
        elif isinstance(action, Hold):
            return StepReport(action.share, breach="p99 over" if action.share == self.breach_at else "")
        return None


def fake() -> FakeServer:
    return FakeServer(control=None, metrics_url="", repository=".", model="enc", log=lambda message: None)


def test_the_executor_runs_the_plan_in_order():
    server = fake()
    reports = server.move(2, (10, 50, 100), hold_s=1.0)
    assert [r.share for r in reports] == [10, 50, 100]
    assert server.actions == plan_move({1, 2}, 1, {1: 90.0, 2: 10.0}, 2, (10, 50, 100), 1.0)
    assert server.state == {"loaded": {2}, "current": 2, "split": {2: 100.0}}


def test_a_breach_rolls_back_with_a_move_of_its_own():
    server = fake()
    server.breach_at = 50
    with pytest.raises(Breach, match="rolled back to version 1 at 50%") as breach:
        server.move(2, (10, 50, 100), hold_s=1.0)
    assert breach.value.rolled_back and [r.share for r in breach.value.steps] == [10, 50]
    at_breach = first(server.actions, Hold, lambda a: a.share == 50)
    # the rollback: version 1 (still loaded) takes all traffic at once, then version 2 is retired
    assert server.actions[at_breach + 1:] == plan_move({1, 2}, 1, {2: 50.0, 1: 50.0}, 1, (100,), hold_s=0)
    assert server.state == {"loaded": {1}, "current": 1, "split": {1: 100.0}}


def test_a_breach_with_stop_leaves_the_split():
    server = fake()
    server.breach_at = 10
    with pytest.raises(Breach, match="stopped at 10%") as breach:
        server.move(2, (10, 50, 100), hold_s=1.0, on_breach="stop")
    assert not breach.value.rolled_back and isinstance(server.actions[-1], Hold)
    assert server.state["split"] == {2: 10.0, 1: 90.0} and server.state["loaded"] == {1, 2}
