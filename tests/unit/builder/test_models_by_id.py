"""The image classifier and Whisper named by Hugging Face id, fetched through the loopback hub
stand-in (tests/support/hf_hub_standin.py, HF_ENDPOINT): the provenance is the hub's (id, commit,
weight sha256), a second resolution sends no request, and the gpu target's default Whisper is the
hub's openai/whisper-large-v3 whenever the hub has it (a tiny stand-in here, so nothing big moves)."""

from __future__ import annotations

import hashlib

import pytest

from repo_builder.speech_pipeline import GPU_HUB_DEFAULT, choose_source
from repo_builder.vision_models import image_model

from tests.support.hf_hub_standin import hub_environment
from tests.unit.builder.test_vision_models import tiny_resnet
from tests.unit.builder.test_whisper_model_choice import TINY


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with hub_environment(monkeypatch, tmp_path / "hf") as standin:
        yield standin


def files_of(folder) -> dict:
    return {p.name: p for p in folder.iterdir() if p.is_file()}


def test_an_image_classifier_by_id_carries_the_hubs_commit_and_hashes(hub, tmp_path):
    folder = tmp_path / "tiny-resnet"
    tiny_resnet(folder, processor={"crop_pct": 0.875, "size": 160})
    commit = hub.add_revision("acme/tiny-resnet", files_of(folder))
    model = image_model("acme/tiny-resnet")
    assert model.name == "resnet10" and model.labels == ("cat", "cup", "other")
    provenance = model.provenance
    assert (provenance.kind, provenance.source, provenance.revision) == ("hub", "acme/tiny-resnet", commit)
    assert dict(provenance.files)["model.safetensors"] == hashlib.sha256(
        (folder / "model.safetensors").read_bytes()).hexdigest()
    sent = len(hub.requests)
    assert image_model("acme/tiny-resnet").provenance.revision == commit
    assert len(hub.requests) == sent  # the cache answered


def test_the_gpu_default_whisper_is_the_hubs_when_the_hub_has_it(hub, tmp_path):
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    folder = tmp_path / "tiny-whisper"
    torch.manual_seed(1)
    WhisperForConditionalGeneration(WhisperConfig(**TINY, init_std=0.1)).save_pretrained(str(folder))
    commit = hub.add_revision(GPU_HUB_DEFAULT, files_of(folder))
    source = choose_source("gpu")
    provenance = source.provenance
    assert (provenance.kind, provenance.source, provenance.revision) == ("hub", GPU_HUB_DEFAULT, commit)
    assert not provenance.random and "the gpu target's default" in provenance.reason
    assert choose_source("embedded").provenance.kind == "package"  # the embedded default stays packaged
