"""The one call graph of the models (triton_pipelines/repository/ensemble_graph.py), without a server: read
from protobuf configs (the builder, the rollout) and from their JSON form (the drain) alike;
``reaches`` through nested ensembles and declared BLS calls; ``callers``; ``unload_order``."""

from __future__ import annotations

import pytest
from google.protobuf import json_format

from repo_builder.files import read_config
from triton_pipelines.repository.ensemble_graph import EnsembleGraph, Step, config_calls
from triton_pipelines.repository.contract import BuiltManifest

from tests.conftest import ensure_repository

# JSON configs as Triton's config API returns them.
CONFIGS = {
    "router": {"parameters": {"bls_dependencies": {"string_value": "*"}}},
    "embed": {"platform": "ensemble", "ensemble_scheduling": {"step": [{"model_name": "tok", "model_version": "-1"},
                                                                       {"model_name": "enc", "model_version": 1}]}},
    "classify": {"platform": "ensemble", "ensemble_scheduling": {"step": [{"model_name": "embed"},
                                                                          {"model_name": "intent"}]}},
    "speech": {"platform": "ensemble", "ensemble_scheduling": {"step": [{"model_name": "features"},
                                                                        {"model_name": "loop"}]}},
    "loop": {"parameters": {"bls_dependencies": {"string_value": "dec, enc_audio"}}},
    "tok": {}, "enc": {}, "intent": {}, "features": {}, "dec": {}, "enc_audio": {},
}


@pytest.fixture
def graph() -> EnsembleGraph:
    return EnsembleGraph.from_configs(CONFIGS)


def test_steps_keep_their_order_and_pinned_versions(graph):
    assert graph.ensembles == ["classify", "embed", "speech"]
    assert graph.steps["embed"] == (Step("tok", -1), Step("enc", 1))
    assert graph.calls("loop") == {"dec", "enc_audio"}
    assert config_calls(CONFIGS["loop"]) == {"dec", "enc_audio"} and config_calls(CONFIGS["router"]) == {"*"}


def test_reaches_through_nested_ensembles_and_bls_calls(graph):
    assert graph.reaches("classify", "enc") and graph.reaches("classify", "tok")
    assert graph.reaches("speech", "dec")
    assert not graph.reaches("speech", "dec", through_bls=False)  # the builder's variants follow steps only
    assert graph.reached("classify", through_bls=False) == {"embed", "intent", "tok", "enc"}
    assert not graph.reaches("embed", "classify") and not graph.reaches("tok", "enc")
    assert graph.reached("router") == set(CONFIGS) - {"router"}  # "*": every other model


def test_callers_count_the_router_as_a_caller_of_everything(graph):
    assert graph.callers("enc") == {"embed", "router"}
    assert graph.callers("embed") == {"classify", "router"}
    assert graph.callers("router") == set()


def test_unload_order_puts_callers_first_and_a_cycle_together(graph):
    assert graph.unload_order() == [["router"], ["classify", "speech"], ["embed", "features", "intent", "loop"],
                                    ["dec", "enc", "enc_audio", "tok"]]
    assert graph.unload_order(["embed", "tok"]) == [["embed"], ["tok"]]
    cycle = EnsembleGraph.from_calls({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    assert cycle.unload_order() == [["c"], ["a", "b"]]
    assert cycle.reaches("a", "a")


def test_a_step_model_outside_the_graph_is_a_leaf():
    graph = EnsembleGraph.from_configs({"embed": CONFIGS["embed"]})
    assert graph.reaches("embed", "tok") and graph.unload_order() == [["embed"]]


def test_the_built_repository_reads_the_same_from_protobuf_and_from_json():
    repository = ensure_repository()
    protos = {name: read_config(repository / name / "config.pbtxt") for name in BuiltManifest.read(repository).models}
    as_json = {name: json_format.MessageToDict(config, preserving_proto_field_name=True)
               for name, config in protos.items()}
    from_protos, from_json = EnsembleGraph.from_configs(protos), EnsembleGraph.from_configs(as_json)
    assert (from_protos.steps, from_protos.bls, from_protos.models) == (from_json.steps, from_json.bls, from_json.models)
    graph = from_protos
    assert graph.reaches("text_classification_batch_v2", "text_encoder_batch", through_bls=False)
    assert graph.reaches("speech_recognition", "whisper_decoder")  # through whisper_decode's BLS calls
    assert graph.callers("text_encoder") == {"text_embedding", "text_embedding_v2", "router"}
    layers = graph.unload_order()
    assert layers[0] == ["router"] and "text_encoder" in layers[-1] and "whisper_decoder" in layers[-1]
