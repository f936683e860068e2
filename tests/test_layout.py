"""The lines the layout draws (docs/DESIGN.md, docs/design-notes.md), held so a later change
cannot erode them: the library imports nothing of the harness, the gates or the CLI."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("suite/arms", "suite/integrations", "suite/files", "suite/record.py")
HARNESS_SIDE = ("suite.harness", "gates", "cli")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _library_files() -> list[Path]:
    files = []
    for place in LIBRARY:
        path = ROOT / place
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def test_the_library_imports_nothing_of_the_harness_the_gates_or_the_cli():
    crossing = {f"{path.relative_to(ROOT)} imports {name}"
                for path in _library_files() for name in _imports(path)
                if any(name == side or name.startswith(side + ".") for side in HARNESS_SIDE)}
    assert not crossing, sorted(crossing)


MAX_MODULE_LINES = 700
SOURCES = ("suite", "gates", "scripts", "cli.py")


def _sources() -> list[Path]:
    files = []
    for place in SOURCES:
        path = ROOT / place
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def test_every_module_stays_within_its_size():
    fat = {str(path.relative_to(ROOT)): lines for path in _sources() if path.parts[-2] != "scripts"
           if (lines := path.read_text().count("\n")) > MAX_MODULE_LINES}
    assert not fat, f"split these along the data flow (at most {MAX_MODULE_LINES} lines): {fat}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_outside_the_tests_uses_another_modules_private_names():
    """A name with a leading underscore is its module's own: what another module needs is made
    public, so a change to a private name cannot break a user elsewhere unseen."""
    crossing = []
    for path in _sources():
        tree = ast.parse(path.read_text())
        ours = {}  # names bound to the suite's or the gates' modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("suite", "gates"):
                crossing += [f"{path.relative_to(ROOT)}: from {node.module} import {a.name}"
                             for a in node.names if _private(a.name)]
                ours.update({a.asname or a.name: node.module for a in node.names})
            elif isinstance(node, ast.Import):
                ours.update({(a.asname or a.name).split(".")[0]: a.name for a in node.names
                             if a.name.split(".")[0] in ("suite", "gates")})
        crossing += [f"{path.relative_to(ROOT)}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and _private(node.attr)
                     and isinstance(node.value, ast.Name) and node.value.id in ours]
    assert not crossing, sorted(set(crossing))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The suite modules `path` imports outside its functions (TYPE_CHECKING blocks included):
    `from pkg import name` counts as pkg.name where that is a module."""
    found = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If):
            body += node.body + node.orelse
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("suite"):
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                      for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("suite")}
    return found & modules


def test_the_suites_modules_import_one_another_without_a_circle():
    files = sorted((ROOT / "suite").rglob("*.py"))
    modules = {_module_name(path) for path in files}
    graph = {_module_name(path): _top_level_imports(path, modules) for path in files}
    # a package's __init__ re-exporting its modules is no circle: they import their siblings, not it
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph.get(name, ())):
            assert state.get(dep) != 1, f"import circle: {' -> '.join(trail[trail.index(dep):] + [dep])}"
            if dep not in state:
                visit(dep, trail + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


# tests of the project itself (its tree, its prose), not of a module, sit at the top of tests/
PROJECT_TESTS = {"test_layout.py", "test_readme.py", "test_docs.py", "test_plans.py"}


def _tested_module(test: Path) -> Path | None:
    """The source module a test file is named for: tests/<dir>/test_<module>[_<topic>].py tests
    suite/<dir>/<module>.py (or <dir>/<module>.py for gates/ and scripts/, cli.py at the top)."""
    folder = test.parent.relative_to(ROOT / "tests")
    words = test.stem.removeprefix("test_").split("_")
    for cut in range(len(words), 0, -1):  # the longest module name first: test_checkpoint_files
        name = "_".join(words[:cut]) + ".py"
        for source in (ROOT / "suite" / folder / name, ROOT / folder / name):
            if source.is_file():
                return source
    return None


def test_the_tests_mirror_the_source_in_one_naming_scheme():
    """A test file's folder is its module's package and its name test_<module>[_<topic>].py, so
    a module's tests are found where the module is; what the tests share is in tests/support."""
    tests = [p for p in (ROOT / "tests").rglob("test_*.py") if p.name not in PROJECT_TESTS]
    strays = sorted(str(p.relative_to(ROOT)) for p in tests if _tested_module(p) is None)
    assert not strays, f"name these tests/<package>/test_<module>[_<topic>].py after the module they test: {strays}"
    helpers = [p for p in (ROOT / "tests").rglob("*.py") if not p.name.startswith("test_") and p.name != "conftest.py"]
    assert all(p.parent == ROOT / "tests" / "support" for p in helpers), helpers  # one place for what tests share


# A figure a run measured, said in a comment or docstring: a duration, "measured 57", "ran 15%
# slower", "1.36 ms read 1.40". Thresholds are code (a comment names their constant) and figures
# live in docs/tuning.md and docs/results, where a rerun replaces them.
_MEASUREMENT = re.compile(
    r"~?\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?(?:us|µs|ms|ns)\b"  # a duration
    r"|\bmeasured (?:at |as |to be )?~?\d"  # "measured 57"
    r"|\b(?:ran|read|took|drifted)\b[^.;]*?\b\d+(?:\.\d+)?(?:%|x\b)"  # "ran 15% slower"
    r"|(?<!at most )(?<!within )\b\d+(?:\.\d+)?% (?:slower|faster)\b",
    re.IGNORECASE)


def _comments_and_docstrings(path: Path):
    """(line number, text) of each comment and each docstring line of a module."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                first = node.body[0].lineno
                yield from ((first + i, line) for i, line in enumerate(doc.splitlines()))


def test_no_source_comment_quotes_a_measurement():
    """Issue 46: a comment states the rule and points to docs/tuning.md; the figure that chose it
    goes stale in a comment, where no rerun replaces it."""
    quoted = [f"{path.relative_to(ROOT)}:{line}: {text.strip()}" for path in _sources()
              for line, text in _comments_and_docstrings(path) if _MEASUREMENT.search(text)]
    assert not quoted, "\n".join(quoted)


@pytest.mark.parametrize("text, quotes", [
    ("an autograd.Function costs ~6 us a call", True),
    ("measured 57 on the H200", True),
    ("a compiled Llama step ran 15% slower", True),
    ("drifted apart by up to 1.35x a round", True),
    ("at most 10% slower: the speedup >= 0.9", False),
    ("1.1x at olmoe and qwen3-30b-a3b", False),
    ("measured in the same run", False),
])
def test_the_measurement_pattern_tells_a_figure_from_a_rule(text, quotes):
    assert bool(_MEASUREMENT.search(text)) is quotes
