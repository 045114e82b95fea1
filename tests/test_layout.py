"""The direction of imports between tunekit's packages (each package's docstring says what it owns
and what it may import). Read from the source with `ast`, so lazy imports inside functions count
as much as those at the top of a module."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "tunekit"

# A package may not import the ones listed against it: the parts below use no trained run, no
# training loop and no command; the loop opens no run and exports nothing; opening a run exports
# nothing; nothing but a command imports a command.
UPWARD = {"train", "runs", "export", "commands"}
FORBIDDEN = {
    "model": UPWARD, "data": UPWARD, "losses": UPWARD, "methods": UPWARD, "speed": UPWARD, "plan": UPWARD,
    "device": UPWARD,
    "infer": UPWARD, "train": {"runs", "export", "commands"}, "runs": {"export", "commands"},
    "export": {"commands"},
}


def _imports(path: Path) -> list[str]:
    """Every module a file imports (`from tunekit import x` counts as tunekit.x)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [f"{node.module}.{a.name}" for a in node.names] if node.module == "tunekit" else [node.module]
    return found


def _package(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path):
    mine = _package(path)
    bad = [m for m in _imports(path) if m.startswith("tunekit.")
           and m.split(".")[1] in FORBIDDEN.get(mine, set()) | ({"commands"} if mine != "commands" else set())]
    assert not bad, f"{path.relative_to(REPO)} ({mine}) imports {bad}"


def _room_graph() -> dict[str, set[str]]:
    """{room: rooms it imports}: a room is a sub-package or a top-level module of tunekit."""
    graph: dict[str, set[str]] = {}
    for path in _sources():
        mine = _package(path)
        for m in _imports(path):
            if m.startswith("tunekit."):
                target = m.split(".")[1]
                if target not in (mine, "__init__"):
                    graph.setdefault(mine, set()).add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle between rooms (as a path a -> b -> ... -> a), or [] if there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return []


def test_no_import_cycle_between_rooms():
    """Lazy imports inside functions count: a cycle through one of them still ties the rooms in a
    knot (a change in one reaches all of them)."""
    cycle = _cycle(_room_graph())
    assert not cycle, " -> ".join(cycle)


def test_the_cycle_check_finds_a_planted_cycle():
    assert _cycle({"config": {"methods"}, "methods": {"plan"}, "plan": {"config"}}) == ["config", "methods", "plan",
                                                                                       "config"]
    assert _cycle({"train": {"plan"}, "plan": {"device"}}) == []


def test_the_config_schema_is_plain_data():
    """tunekit/config.py imports nothing of tunekit: every room may read the schema, and the schema
    depends on no room."""
    assert [m for m in _imports(PACKAGE / "config.py") if m.startswith("tunekit")] == []


def test_kernels_import_only_torch_and_triton():
    allowed = {"torch", "triton", "numpy", "tunekit_kernels", *sys.stdlib_module_names}
    for path in sorted((REPO / "kernels").rglob("*.py")):
        for m in _imports(path):
            assert m.split(".")[0] in allowed | {""}, f"{path.relative_to(REPO)} imports {m}"


def test_the_planted_upward_import_is_caught(tmp_path):
    """The rule's own check: a model module that imports the loop is named."""
    planted = tmp_path / "x.py"
    planted.write_text("def f():\n    from tunekit.train.loop import TrainRecipe\n")
    assert "tunekit.train.loop" in _imports(planted)
    assert "train" in FORBIDDEN["model"]


@pytest.mark.parametrize("init", sorted(PACKAGE.glob("*/__init__.py")), ids=lambda p: p.parent.name)
def test_every_package_says_what_it_owns(init):
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and len(doc.split()) >= 12, f"{init.relative_to(REPO)}: a docstring saying what the package owns"


def test_every_package_is_installed():
    """pyproject.toml lists its packages by hand: a new folder missing there works from a checkout
    and is absent from an installed tunekit."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found - listed == set()


LONGEST_FUNCTION = 120  # lines: a function longer than a screenful or two is several steps to be named


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_is_longer_than_a_few_screens(path):
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > LONGEST_FUNCTION]
    assert not long, f"{path.relative_to(REPO)}: {long}"
