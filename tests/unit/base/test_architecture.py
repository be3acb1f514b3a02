"""The house rules, checked: the runtime package is layered (an import never runs up a layer), no
import cycle in src/, build/ or tools/, at most 8 modules at the package's top level, and no module
over 600 lines, class over 250 or function over 80 (docs/architecture.md)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from tests.support.paths import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "src" / "triton_pipelines"
# Bottom to top. The package's top-level modules are the base; ``__main__`` (the CLI) is above all.
LAYERS = ("telemetry", "repository", "gateway", "pipelines", "stub", "front", "openai_api", "server", "ops")
MAX_TOP_LEVEL_MODULES = 8
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 600, 250, 80


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str) -> set[str]:
    """Modules ``path`` imports, at module level or inside functions, absolute or relative."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def graph(root: Path, top: str) -> dict[str, set[str]]:
    """Our modules under ``root`` whose names start with ``top`` → the ones of them each imports."""
    files = {module_name(path, root): path for path in (root / top).rglob("*.py")}
    return {name: {other for other in imports(path, name) if other in files and other != name}
            for name, path in files.items()}


def layer(name: str) -> int:
    parts = name.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in LAYERS):
        return len(LAYERS) + 1 if parts[-1] == "__main__" else -1
    return LAYERS.index(parts[1])


def test_imports_never_run_up_a_layer():
    upward = {f"{name} -> {other}" for name, others in graph(PROJECT_ROOT / "src", "triton_pipelines").items()
              for other in others if layer(other) > layer(name)}
    assert not upward, f"imports up a layer (LAYERS): {sorted(upward)}"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for other in sorted(edges.get(node, ())):
            if state.get(other) == "open":
                found.append(stack[stack.index(other):] + [other])
            elif other not in state:
                visit(other)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_no_import_cycles():
    for root, top in ((PROJECT_ROOT / "src", "triton_pipelines"), (PROJECT_ROOT / "build", "repo_builder"),
                      (PROJECT_ROOT, "tools")):
        edges = graph(root, top)
        # a package's __init__ is imported with each of its modules: not a cycle by itself
        edges = {name: {o for o in others if not name.startswith(o + ".")} for name, others in edges.items()}
        assert not cycles(edges), cycles(edges)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_at_most_eight_modules_at_the_top_of_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} <= {*LAYERS}


def oversized() -> set[str]:
    found = set()
    for top in ("src", "build", "tools"):
        for path in sorted((PROJECT_ROOT / top).rglob("*.py")):
            rel = path.relative_to(PROJECT_ROOT)
            text = path.read_text()
            if text.count("\n") > MAX_MODULE_LINES:
                found.add(f"module {rel}")
            for node in ast.walk(ast.parse(text)):
                size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                    found.add(f"class {rel}:{node.name}")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION_LINES:
                    found.add(f"function {rel}:{node.name}")
    return found


def test_no_module_class_or_function_over_its_size():
    assert not oversized(), f"over the size rules: {sorted(oversized())}"


def test_every_subpackage_is_packaged():
    """pyproject's explicit package list names every package folder (a missing one is left out of the
    wheel and of the serving image)."""
    packages = set(tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for root, top in ((PROJECT_ROOT / "src", "triton_pipelines"), (PROJECT_ROOT / "build", "repo_builder")):
        folders = {module_name(p, root) for p in (root / top).rglob("__init__.py")}
        assert folders == {p for p in packages if p.split(".")[0] == top}, folders ^ packages
