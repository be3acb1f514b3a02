"""Warm-up: every compute model's generated config carries ``model_warmup`` that Triton runs on each
instance while loading it (before the version is READY), and one request through an ensemble
(``warmup.warm_pipelines``, which the launcher sends for every loaded ensemble before it announces
the server ready) runs every step of the pipeline. The latency effect is measured by
``make lifecycle`` (docs/lifecycle.md), not asserted here: a shared machine's timings would make it
flaky."""

from __future__ import annotations


from triton_pipelines.client import TritonClient
from triton_pipelines.server.drain import dependencies
from triton_pipelines.server.warmup import sample_inputs
from tests.conftest import image_classifier




def executions(client: TritonClient, model: str, version: str = "") -> int:
    stats = client.statistics(model)["model_stats"]
    return sum(int(s.get("execution_count", 0)) for s in stats if not version or s["version"] == version)


def test_a_load_runs_the_warmup_before_the_version_is_ready(compute_server):
    """Loaded again with new instances: when ``load`` returns (the version is READY) each new
    instance has already executed its warm-up sample, with no request sent (the statistics start
    anew with the new model: they count exactly the warm-up)."""
    client = TritonClient("http", compute_server.http_url)
    for model in ("text_encoder", image_classifier(), "whisper_encoder", "whisper_decoder"):
        config = compute_server.control.config(model)
        samples = len(config["model_warmup"])
        versions = [str(v) for v in config.get("version_policy", {}).get("specific", {}).get("versions", [1])]
        config.setdefault("parameters", {})["warmup_test"] = {"string_value": "1"}
        compute_server.control.load(model, config=config)
        for version in versions:
            assert executions(client, model, version) == samples, (model, version)
        del config["parameters"]["warmup_test"]
        compute_server.control.load(model, config=config)  # back to the served config
    client.close()


def pipeline_steps(control, model: str) -> set[str]:
    config = control.config(model)
    steps = set() if config.get("platform") == "ensemble" else {model}
    for name in dependencies(config) - {"*"}:
        steps |= pipeline_steps(control, name)
    return steps


def test_pipeline_warmup_runs_every_step_of_every_loaded_ensemble(triton_server, http_client):
    """What the launcher does before it says ready (``--no-pipeline-warmup`` skips it)."""
    control = triton_server.control
    ensembles = sorted(e["name"] for e in control.index(ready_only=True)
                       if control.config(e["name"]).get("platform") == "ensemble")
    steps = {name: pipeline_steps(control, name) for name in ensembles}
    assert {"text_tokenizer", "text_encoder"} <= steps["text_embedding"]
    assert {"whisper_encoder", "whisper_decoder"} <= steps.get("speech_recognition", {"whisper_encoder", "whisper_decoder"})
    before = {m: executions(http_client, m) for m in set().union(*steps.values())}
    warmed = triton_server.warm_pipelines()
    assert sorted(w.model for w in warmed) == ensembles
    ran = {m for m in before if executions(http_client, m) > before[m]}
    for name in ensembles:
        assert steps[name] <= ran, (name, steps[name] - ran)


def test_samples_exist_for_every_pipeline_input(triton_server):
    control = triton_server.control
    for entry in control.index(ready_only=True):
        config = control.config(entry["name"])
        if config.get("platform") == "ensemble":
            inputs = sample_inputs(config)
            assert set(inputs) >= {t["name"] for t in config["input"] if not t.get("optional")}
