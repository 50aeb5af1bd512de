"""The package layering: no package imports one above it (read from the source with `ast`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tokenmill

ROOT = Path(tokenmill.__file__).parent

# Higher imports lower, never the other way; equal ranks may import each other. The engine
# drives the runner, the runner the model, the model its layers, the layers the kernels; the
# batch types and the cache sit below them all so that each can name a request or a page list.
# Packages not listed (entrypoints, bench, tokenization, ipc, observability, ...) are not ranked.
RANKS = {
    "engine": 8,
    "runner": 7,
    "models": 6,
    "attention": 5,  # the attention front the models call; it uses the layers' helpers
    "layers": 4,
    "kernels": 3,
    "batch": 2,
    "cache": 1,
    "vision": 1,  # a prompt's images as plain arrays (batch holds them), their preprocessing
}


def _package(module: str) -> str | None:
    """`tokenmill.<package>...` -> package (a top-level module counts as a package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "tokenmill" else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported tokenmill module) of every import in a file, type-checking ones too."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def layering_violations(root: Path) -> list[str]:
    """`file:line: a imports b` for each import of a higher-ranked package by a lower one."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        source = path.relative_to(root).with_suffix("").parts[0]
        for line, module in _imports(path):
            target = _package(module)
            if target is None or target == source:
                continue
            if source in RANKS and target in RANKS and RANKS[target] > RANKS[source]:
                bad.append(f"{path.relative_to(root)}:{line}: {source} imports {target}")
    return bad


def test_no_package_imports_one_above_it() -> None:
    assert layering_violations(ROOT) == []


@pytest.mark.parametrize(
    ("package", "statement", "target"),
    [
        ("cache", "from tokenmill.engine.engine_core import EngineCore", "engine"),
        ("cache", "from tokenmill.batch import Request", "batch"),
        ("runner", "import tokenmill.engine.scheduler", "engine"),
        ("kernels", "from tokenmill.layers.linear import Linear", "layers"),
    ],
)
def test_an_upward_import_is_found(
    tmp_path: Path, package: str, statement: str, target: str
) -> None:
    (tmp_path / package).mkdir()
    (tmp_path / package / "mod.py").write_text(f"if True:\n    {statement}\n")
    assert layering_violations(tmp_path) == [f"{package}/mod.py:2: {package} imports {target}"]


def test_a_downward_import_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "mod.py").write_text("from tokenmill.runner import model_runner\n")
    assert layering_violations(tmp_path) == []
