"""The README stays true: its commands exist and every built model is in its model table."""

from pathlib import Path

import re

from repo_builder.__main__ import parse_context
from tests.support.paths import PROJECT_ROOT

ROOT = PROJECT_ROOT
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


def layout_entries() -> list[str]:
    """The left column of the README's layout block, indented entries under their folder."""
    block = README.split("## Layout", 1)[1].split("```", 2)[1]
    entries, folder = [], ""
    for line in block.splitlines():
        column = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0] if line.strip() else ""
        if not column or line.startswith(" " * 20):  # blank, or a continuation of the description
            continue
        names = [name.strip() for name in column.split(",")]
        if line.startswith("  "):
            entries += [folder + name for name in names]
        else:
            entries += names
            folder = names[0] if names[0].endswith("/") else folder
    return entries


def test_readme_layout_matches_the_code():
    entries = layout_entries()
    for entry in entries:
        if entry == "model_repository/":  # generated
            continue
        pattern = re.sub(r"<[^>]+>", "*", entry)
        assert list(ROOT.glob(pattern.rstrip("/"))), f"README layout names {entry}: not in the project"
    named = {Path(entry).name for entry in entries}
    patterns = [re.sub(r"<[^>]+>", "*", Path(entry).name) for entry in entries if "<" in entry]
    for package in (ROOT / "src" / "triton_pipelines", ROOT / "build" / "repo_builder"):
        for module in sorted(package.glob("*.py")):
            if module.name in ("__init__.py", "__main__.py"):
                continue
            assert module.name in named or any(Path(module.name).match(p) for p in patterns), \
                f"README layout does not name {module.relative_to(ROOT)}"
