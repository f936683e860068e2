"""The lines the layout draws (docs/DESIGN.md, docs/design-notes.md), held so a later change
cannot erode them: the library imports nothing of the harness, the gates or the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

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
