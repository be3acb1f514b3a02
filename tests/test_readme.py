"""The README stays true: its commands exist and every built model is in its model table."""

from pathlib import Path

import re

from repo_builder.__main__ import parse_context

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_starts_with_the_two_commands_and_they_are_make_targets():
    makefile = (ROOT / "Makefile").read_text()
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    assert "make serve" in first_block and "make test" in first_block
    for target in re.findall(r"`make (\w+)", README):
        assert re.search(rf"^{target}:", makefile, re.M), f"README mentions make {target}"


def test_every_compute_model_is_in_the_readme_model_table():
    context, pipelines = parse_context(["--with-bert-base"])
    for pipeline in pipelines:
        for model in pipeline.compute_models(context):
            assert f"| `{model.name}`" in README, model.name
        for name in pipeline.python_models:
            assert f"`{name}`" in README, name
        for name in pipeline.ensembles:
            assert f"`{name}`" in README, name


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
