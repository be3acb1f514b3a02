"""The README stays true and short: its commands exist, it names every pipeline, its "where to change\nwhat" rows each name one existing path; docs/pipelines.md has every built model in its model table;\ndocs/architecture.md's layout names every module."""

import fnmatch
import re

from repo_builder.__main__ import parse_context
from tests.support.paths import PROJECT_ROOT

ROOT = PROJECT_ROOT
README = (ROOT / "README.md").read_text()
PIPELINES_DOC = (ROOT / "docs" / "pipelines.md").read_text()
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def test_readme_starts_with_the_two_commands_and_they_are_make_targets():
    makefile = (ROOT / "Makefile").read_text()
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    assert "make serve" in first_block and "make test" in first_block
    for target in re.findall(r"`make (\w+)", README):
        assert re.search(rf"^{target}:", makefile, re.M), f"README mentions make {target}"


def test_every_model_is_in_the_pipelines_model_table_and_every_pipeline_in_the_readme():
    context, pipelines = parse_context(["--with-bert-base"])
    for pipeline in pipelines:
        for model in pipeline.compute_models(context):
            assert f"| `{model.name}`" in PIPELINES_DOC, model.name
        for name in [*pipeline.python_models, *pipeline.ensembles]:
            assert f"`{name}`" in PIPELINES_DOC, name
            assert f"`{name}`" in README, name


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def layout_entries() -> list[str]:
    """The left column of docs/architecture.md's layout block, indented entries under their folder."""
    block = ARCHITECTURE.split("## Layout", 1)[1].split("```", 2)[1]
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


def glob_pattern(entry: str) -> str:
    return re.sub(r"<[^>]+>", "*", entry).rstrip("/")


def test_the_architecture_layout_matches_the_code():
    entries = layout_entries()
    for entry in entries:
        if entry == "model_repository/":  # generated
            continue
        assert list(ROOT.glob(glob_pattern(entry))), f"docs/architecture.md's layout names {entry}: not in the project"
    patterns = [glob_pattern(entry) for entry in entries]
    for package in (ROOT / "src" / "triton_pipelines", ROOT / "build" / "repo_builder"):
        for module in sorted(package.rglob("*.py")):
            if module.name in ("__init__.py", "__main__.py") and module.parent == package:
                continue
            if module.name == "__init__.py" or "__pycache__" in module.parts:
                continue
            relative = module.relative_to(ROOT).as_posix()
            assert any(fnmatch.fnmatchcase(relative, pattern) for pattern in patterns), \
                f"docs/architecture.md's layout does not name {relative}"


def where_to_change_rows() -> list[tuple[str, str]]:
    section = README.split("## Where to change what", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and rule
    return [tuple(cell.strip() for cell in row.strip("|").rsplit("|", 1)) for row in rows]


def test_the_readme_is_an_entry_point():
    assert len(README.splitlines()) <= 250
    rows = where_to_change_rows()
    assert len(rows) >= 8
    for what, where in rows:
        paths = re.findall(r"`([^`]+)`", where)
        assert len(paths) == 1, f"README 'where to change what': {what!r} names {paths}, not one path"
        assert list(ROOT.glob(glob_pattern(paths[0]))), f"README 'where to change what' names {paths[0]}: not in the project"
    for needed in ("src/triton_pipelines/limits.py", "data/routes.yaml", "src/triton_pipelines/errors.py",
                   "src/triton_pipelines/__main__.py", "src/triton_pipelines/openai_api/"):
        assert any(needed in where for _, where in rows), needed


def test_the_readme_links_to_docs_that_exist():
    for target in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / target).exists(), target
