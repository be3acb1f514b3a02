"""Weights by Hugging Face id (repo_builder.hub) through huggingface_hub against a loopback stand-in
for the hub (tests/support/hf_hub_standin.py, reached through HF_ENDPOINT): download, revision
pinning, the cache reused with no request, offline with a warm cache, and one-line failures."""

from __future__ import annotations

import hashlib
import json

import pytest

from repo_builder.hub import WeightsError, parse_hub_id, resolve_model, resolve_optional

from tests.support.hf_hub_standin import hub_environment

FILES = ("*.json", "*.safetensors", "README.md")
REPO = "acme/tiny-encoder"


def tiny_files(seed: int) -> dict[str, bytes]:
    """A small model repo: its config, a safetensors file of ``seed``'s bytes, a card."""
    tensor = bytes(range(seed, seed + 16))
    header = json.dumps({"w": {"dtype": "U8", "shape": [4, 4], "data_offsets": [0, 16]}}).encode()
    weights = len(header).to_bytes(8, "little") + header + tensor
    return {"config.json": json.dumps({"hidden_size": 4, "seed": seed}).encode(), "model.safetensors": weights,
            "README.md": b"---\nlicense: mit\n---\n# tiny\n"}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with hub_environment(monkeypatch, tmp_path / "hf") as standin:
        yield standin


def resolve(spec: str, **kwargs):
    return resolve_model(spec, FILES, architecture="tiny", flag="--text-model", **kwargs)


def test_a_model_by_id_is_downloaded_with_its_commit_and_weight_hashes(hub, tmp_path):
    files = tiny_files(1)
    commit = hub.add_revision(REPO, files)
    resolved = resolve(REPO)
    assert resolved.path == tmp_path / "hf" / "hub" / "models--acme--tiny-encoder" / "snapshots" / commit
    assert json.loads((resolved.path / "config.json").read_text())["seed"] == 1
    provenance = resolved.provenance
    assert (provenance.kind, provenance.source, provenance.revision) == ("hub", REPO, commit)
    assert provenance.files == (("model.safetensors", hashlib.sha256(files["model.safetensors"]).hexdigest()),)
    assert provenance.licence == "mit" and provenance.parameters == 16  # the card's, the safetensors' count
    assert provenance.config_parameters()["weights_revision"] == commit


def test_a_pinned_revision_is_served_and_the_branch_moves_on(hub):
    first = hub.add_revision(REPO, tiny_files(1), refs=("main", "v1"))
    second = hub.add_revision(REPO, tiny_files(2), refs=("main",))
    assert resolve(f"{REPO}@v1").provenance.revision == first
    assert json.loads((resolve(f"{REPO}@{first}").path / "config.json").read_text())["seed"] == 1
    latest = resolve(REPO)
    assert latest.provenance.revision == second
    assert json.loads((latest.path / "config.json").read_text())["seed"] == 2


def test_a_second_resolution_sends_no_request_and_offline_uses_the_warm_cache(hub, monkeypatch):
    commit = hub.add_revision(REPO, tiny_files(1))
    first = resolve(REPO)
    assert hub.count("/" + REPO + "/resolve/") > 0  # downloaded
    sent = len(hub.requests)
    again = resolve(REPO)
    assert len(hub.requests) == sent and again == first
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve(f"{REPO}@{commit}").path == first.path
    assert resolve(REPO).provenance.revision == commit and len(hub.requests) == sent


def test_offline_with_a_cold_cache_fails_in_one_line_naming_the_remedies(hub, monkeypatch):
    hub.add_revision(REPO, tiny_files(1))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsError) as caught:
        resolve(REPO)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"--text-model {REPO}: not in the Hugging Face cache")
    for remedy in ("HF_HUB_OFFLINE", "cache volume", "local folder", "offline default"):
        assert remedy in message
    assert hub.requests == []


@pytest.mark.parametrize("spec, expected", [
    ("acme/no-such-model", "no model acme/no-such-model on http://127.0.0.1:"),
    (f"{REPO}@v9", f"{REPO} has no revision 'v9'"),
])
def test_an_unknown_id_or_revision_fails_in_one_line(hub, spec, expected):
    hub.add_revision(REPO, tiny_files(1))
    with pytest.raises(WeightsError) as caught:
        resolve(spec)
    assert "\n" not in str(caught.value) and expected in str(caught.value)


def test_a_gated_model_needs_hf_token(hub, monkeypatch):
    hub.add_revision(REPO, tiny_files(1), token="hf_secret")
    with pytest.raises(WeightsError, match="is gated on .*set HF_TOKEN"):
        resolve(REPO)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert resolve(REPO).provenance.source == REPO


def test_a_corrupted_download_is_refused(hub):
    hub.add_revision(REPO, tiny_files(1))
    hub.corrupt(REPO, "model.safetensors")
    with pytest.raises(WeightsError) as caught:
        resolve(REPO)
    assert "\n" not in str(caught.value)
    assert "model.safetensors is corrupted (its sha256 is not the hub's" in str(caught.value)


def test_an_expected_sha256_that_does_not_match_fails(hub):
    files = tiny_files(1)
    hub.add_revision(REPO, files)
    good = hashlib.sha256(files["model.safetensors"]).hexdigest()
    assert resolve(REPO, expected_sha256={"model.safetensors": good}).provenance.files[0][1] == good
    with pytest.raises(WeightsError, match="sha256 mismatch for model.safetensors"):
        resolve(REPO, expected_sha256={"model.safetensors": "0" * 64})


def test_the_hub_unreachable_fails_or_is_a_reason_for_a_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard: nothing listens
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(WeightsError, match="hub http://127.0.0.1:9 not reachable .*local folder"):
        resolve(REPO)
    reason = resolve_optional(REPO, FILES, architecture="tiny")
    assert isinstance(reason, str) and reason.startswith("hub http://127.0.0.1:9 not reachable")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE" in resolve_optional(REPO, FILES, architecture="tiny")


def test_resolve_optional_returns_the_model_when_it_can_be_had(hub):
    hub.add_revision(REPO, tiny_files(1))
    resolved = resolve_optional(REPO, FILES, architecture="tiny", reason="the gpu default")
    assert not isinstance(resolved, str) and resolved.provenance.reason == "the gpu default"


def test_a_folder_is_served_as_it_is_and_a_path_that_is_not_one_fails(tmp_path):
    for name, data in tiny_files(3).items():
        (tmp_path / name).write_bytes(data)
    resolved = resolve(str(tmp_path))
    assert resolved.provenance.kind == "folder" and resolved.provenance.source == str(tmp_path)
    assert resolved.provenance.files[0][0] == "model.safetensors"
    with pytest.raises(WeightsError, match="no such folder, and not a Hugging Face id"):
        resolve(str(tmp_path / "missing"))
    with pytest.raises(WeightsError, match="has no tokenizer.json"):
        resolve(str(tmp_path), required_files=("tokenizer.json",))


def test_hub_ids():
    assert parse_hub_id("BAAI/bge-small-en-v1.5") == ("BAAI/bge-small-en-v1.5", None)
    assert parse_hub_id("openai/whisper-large-v3@refs/pr/1") == ("openai/whisper-large-v3", "refs/pr/1")
    assert parse_hub_id("bert-base-uncased@main") == ("bert-base-uncased", "main")
    assert parse_hub_id("./models/x") is None and parse_hub_id("/abs/x") is None and parse_hub_id("a/b/c") is None
