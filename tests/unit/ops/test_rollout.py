"""The rollout's logic without a server: metrics parsing, the gate, the family read from the
repository (the rollout under load: tests/server/test_rollout.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from triton_pipelines.ops.rollout import Family, Gate, Metrics, Rollout, StepReport, judge

from tests.conftest import ensure_repository

def test_metrics_parse_sums_matching_samples():
    text = ('# HELP x\nnv_inference_request_failure{model="a",version="1"} 2\n'
            'nv_inference_request_failure{model="b",version="1"} 3\n'
            'nv_inference_request_summary_us{model="a",version="2",quantile="0.99"} NaN\n'
            'router_failures_total{task="t",route="triton",reason="invalid_input"} 4\n')
    metrics = Metrics.parse(text)
    assert metrics.total("nv_inference_request_failure", version="1") == 5
    assert metrics.total("nv_inference_request_failure", model=["a", "c"]) == 2
    assert metrics.total("router_failures_total", task=()) == 0
    assert metrics.largest("nv_inference_request_summary_us", model="a") != metrics.largest(
        "nv_inference_request_summary_us", model="a")  # NaN: no observations in the window


@pytest.mark.parametrize("report, gate, breach", [
    (StepReport(10, requests=100, failures=0, target_requests=10, p99_ms=50), Gate(), ""),
    (StepReport(10, requests=100, failures=1, target_requests=10, p99_ms=50), Gate(), "1 of 100 requests failed"),
    (StepReport(10, requests=100, failures=1), Gate(max_failure_ratio=0.02), ""),
    (StepReport(10, failures=2), Gate(), "2 failures"),
    (StepReport(10, requests=100, target_requests=60, p99_ms=300), Gate(max_p99_ms=250), "p99 300.0 ms over 250"),
    (StepReport(10, requests=100, target_requests=10, p99_ms=300), Gate(max_p99_ms=250), ""),  # too few to judge
    (StepReport(10, requests=100, target_requests=60, p99_ms=300, old_p99_ms=100), Gate(max_p99_ratio=2.0),
     "over 2 x the old"),
    (StepReport(10, requests=100, target_requests=60, p99_ms=150, old_p99_ms=100), Gate(max_p99_ratio=2.0), ""),
])
def test_gate(report, gate, breach):
    found = judge(gate, report)
    assert (breach in found) if breach else found == ""


def test_family_from_the_built_repository():
    family = Family.from_repository(ensure_repository(), "text_encoder")
    assert family.members == ("text_encoder", "text_encoder_batch")
    assert family.pinning_ensembles == {"text_embedding": "text_encoder", "text_embedding_batch": "text_encoder_batch"}
    assert family.versioned_ensembles == {2: ("text_classification_batch_v2", "text_classification_v2",
                                              "text_embedding_batch_v2", "text_embedding_v2")}
    assert family.canary_tasks == ("text_classification", "text_embedding") and family.router_versions == (1, 2)
    assert family.ensembles_serving(1) == ("text_embedding", "text_embedding_batch")


def test_split_file_is_replaced_whole_and_keeps_other_models(tmp_path):
    class Stub(Rollout):
        def __post_init__(self):
            self.split_file = Path(self.split_file)

    split = tmp_path / "splits.json"
    split.write_text(json.dumps({"other_model": {"1": 100}}))
    stub = Stub(control=None, metrics_url="", repository=tmp_path, model="text_encoder", split_file=split)
    stub.write_split({1: 0.0, 2: 100.0})
    assert json.loads(split.read_text()) == {"other_model": {"1": 100}, "text_encoder": {"2": 100.0}}
    assert not list(tmp_path.glob(".splits-*"))


def test_a_rollout_refuses_a_launcher_with_several_replicas(tmp_path):
    """Each replica is its own tritonserver: moving one would leave nginx's round robin serving a mix."""
    from triton_pipelines.ops.rollout import RolloutError, connect

    (tmp_path / "control.key").write_text("key")
    server = {"triton_http": "127.0.0.1:1", "triton_metrics": "127.0.0.1:2",
              "replicas": [{"triton_http": "127.0.0.1:1"}, {"triton_http": "127.0.0.1:3"}]}
    (tmp_path / "server.json").write_text(json.dumps(server))
    with pytest.raises(RolloutError, match="2 replicas"):
        connect(tmp_path)
    server["replicas"] = server["replicas"][:1]
    (tmp_path / "server.json").write_text(json.dumps(server))
    assert connect(tmp_path)[1] == "http://127.0.0.1:2/metrics"


class RecordingControl:
    """The three calls of the control API the re-pin and ``uncache`` make, on configs in memory."""

    def __init__(self, configs: dict[str, dict]):
        self.configs = configs
        self.loads: list[tuple[str, dict]] = []

    def states(self):
        return {name: "READY" for name in self.configs}

    def config(self, name):
        return json.loads(json.dumps(self.configs[name]))

    def load(self, name, config=None):
        self.loads.append((name, config))
        self.configs[name] = config


def test_a_re_pin_or_new_files_turn_the_response_cache_off_where_answers_change(tmp_path):
    """Triton's cache key is the model's name, version and inputs: after a re-pin or new files the
    cached ensemble would answer with the old version's embeddings, so it is reloaded uncached."""
    from triton_pipelines.ops.rollout_replace import VersionSwap, without_response_cache

    assert without_response_cache({"name": "a"}) == {"name": "a"}
    assert without_response_cache({"response_cache": {"enable": True}}) == {"response_cache": {"enable": False}}
    family = Family.from_repository(ensure_repository(), "text_encoder")
    step = {"model_name": "text_encoder", "model_version": 1}
    control = RecordingControl({
        "text_embedding": {"response_cache": {"enable": True}, "ensemble_scheduling": {"step": [dict(step)]}},
        "text_embedding_batch": {"ensemble_scheduling": {"step": [dict(step, model_name="text_encoder_batch")]}},
        "text_embedding_v2": {"response_cache": {"enable": True}}})
    swap = VersionSwap(control, tmp_path, "text_encoder", family, log=lambda message: None, members=lambda: [])
    swap.pin(2)
    assert [name for name, _ in control.loads] == ["text_embedding", "text_embedding_batch"]
    assert control.configs["text_embedding"]["response_cache"] == {"enable": False}
    assert control.configs["text_embedding"]["ensemble_scheduling"]["step"][0]["model_version"] == 2
    assert "response_cache" not in control.configs["text_embedding_batch"]
    control.loads.clear()
    swap.uncache(["text_embedding", "text_embedding_batch", "text_embedding_v2", "not_loaded"])
    assert [name for name, _ in control.loads] == ["text_embedding_v2"]  # the others are uncached already
    assert control.configs["text_embedding_v2"]["response_cache"] == {"enable": False}
