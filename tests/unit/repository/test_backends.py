"""triton_pipelines.repository.backends: models a backend folder cannot serve (the launcher leaves them out)."""

from __future__ import annotations

from triton_pipelines.repository.backends import needs, unloadable


def _model(repository, name, text):
    (repository / name).mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(text)


def test_needs_reads_backend_platform_and_ensemble_steps():
    assert needs('name: "a"\nbackend: "python"\n') == ("python", set())
    assert needs('platform: "onnxruntime_onnx"\n') == ("onnxruntime", set())
    assert needs('platform: "tensorrt_plan"\n') == ("tensorrt", set())
    steps = 'platform: "ensemble"\nensemble_scheduling { step [ { model_name: "a" }, { model_name: "b" } ] }\n'
    assert needs(steps) == (None, {"a", "b"})


def test_unloadable_names_models_without_backend_and_ensembles_on_them(tmp_path):
    repository, backends = tmp_path / "models", tmp_path / "backends"
    (backends / "python").mkdir(parents=True)
    _model(repository, "tokenizer", 'backend: "python"\n')
    _model(repository, "encoder", 'platform: "onnxruntime_onnx"\n')
    _model(repository, "plan", 'platform: "tensorrt_plan"\n')
    _model(repository, "embedding", 'platform: "ensemble"\nensemble_scheduling { step [ { model_name: "tokenizer" }, '
                                     '{ model_name: "encoder" } ] }\n')
    _model(repository, "classification", 'platform: "ensemble"\nensemble_scheduling { step [ '
                                          '{ model_name: "embedding" } ] }\n')
    _model(repository, "python_only", 'platform: "ensemble"\nensemble_scheduling { step [ '
                                       '{ model_name: "tokenizer" } ] }\n')
    why = unloadable(repository, backends)
    assert sorted(why) == ["classification", "embedding", "encoder", "plan"]
    assert "onnxruntime" in why["encoder"] and "tensorrt" in why["plan"]
    (backends / "onnxruntime").mkdir()
    (backends / "tensorrt").mkdir()
    assert unloadable(repository, backends) == {}


class _Started(Exception):
    pass


def _launch(monkeypatch, repository, backends):
    from triton_pipelines.server import launcher

    seen = {}

    def fake_launcher(options, *args, **kwargs):
        seen["models"] = options.models
        raise _Started

    monkeypatch.setattr(launcher, "Launcher", fake_launcher)
    try:
        launcher.main(["--model-repository", str(repository), "--tritonserver", "/bin/true",
                       "--backend-dir", str(backends)])
    except _Started:
        return seen["models"]
    raise AssertionError("the launcher did not start")


def test_the_launcher_leaves_out_what_its_backends_cannot_serve_and_says_so(tmp_path, monkeypatch, capsys):
    """The serving image's stand-in has only the Python backend: tritonserver would exit at start on
    the gpu target's ONNX Runtime/TensorRT models; the launcher names them and loads the rest."""
    repository, backends = tmp_path / "models", tmp_path / "backends"
    (backends / "python").mkdir(parents=True)
    repository.mkdir()
    (repository / ".built").write_text("{}")
    _model(repository, "tokenizer", 'backend: "python"\n')
    _model(repository, "encoder", 'platform: "onnxruntime_onnx"\n')
    _model(repository, "embedding", 'platform: "ensemble"\nensemble_scheduling { step [ { model_name: "tokenizer" }, '
                                     '{ model_name: "encoder" } ] }\n')
    assert _launch(monkeypatch, repository, backends) == ["tokenizer"]
    err = capsys.readouterr().err
    assert "[launcher] not loading 2 models" in err and "encoder (backend 'onnxruntime'" in err
    (backends / "onnxruntime").mkdir()
    assert _launch(monkeypatch, repository, backends) is None  # all servable: --load-model=* as before
