"""Which built models use Triton's response cache: the text_embedding and image_logits ensembles
(the plain and the latency-class variant; not the canary's ``_v<N>``, whose requests the rollout's
gate must see reach their version), and nothing else. Why (measured on 2.51): an ensemble caches only its successful answers, but a step
model caches its error responses as empty successes (the next identical request then fails inside
the ensemble with another error); image_classification's top_k is a request parameter, which the
cache key leaves out (so its nested image_logits is cached, and the top-k step runs after it); the router's gateway tasks answer per key and per call; decoupled models cannot
be cached. The cache at work: tests/server/test_response_cache.py."""

from __future__ import annotations

from repo_builder.files import read_config

from tests.conftest import ensure_repository

CACHED = {"text_embedding", "text_embedding_batch", "image_logits", "image_logits_batch"}


def built_configs():
    repository = ensure_repository()
    return {path.parent.name: read_config(path) for path in sorted(repository.glob("*/config.pbtxt"))}


def test_only_the_text_embedding_and_image_logits_ensembles_are_cached():
    configs = built_configs()
    cached = {name for name, config in configs.items() if config.response_cache.enable}
    assert cached == CACHED
    for name in cached:
        config = configs[name]
        assert config.platform == "ensemble" and not config.model_transaction_policy.decoupled
        # their steps are not: an error answer of a step would be kept
        assert not any(configs[step.model_name].response_cache.enable for step in config.ensemble_scheduling.step)


def test_no_excluded_model_is_cached():
    configs = built_configs()
    excluded = [name for name, config in configs.items()
                if name.startswith(("speech", "whisper", "router", "image_classification", "image_preprocess", "audio")) or name.endswith("_v2")
                or config.model_transaction_policy.decoupled or config.platform != "ensemble"]
    assert {"router", "speech_recognition_stream", "image_classification", "text_embedding_v2"} <= set(excluded)
    assert not [name for name in excluded if configs[name].response_cache.enable]
