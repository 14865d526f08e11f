"""The edge agent's rooms: every module is on the map, the layers contract names every room,
at most 8 modules at the top, and no own-module import hides inside a function unless it keeps a
heavy optional dependency off a light import (and says so in a ``# heavy:`` comment)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import edge_agent

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "edge_agent"
TRAINING = PACKAGE / "training"
"""Its own room with its own map; it may keep torch/Flower/Opacus imports lazy."""
CONTRACT = "edge_agent rooms: each imports only the rooms below it"


def _dotted(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if TRAINING not in p.parents)


def _contract_layers() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"] == CONTRACT]
    assert contract["type"] == "layers"
    assert contract["containers"] == ["edge_agent"]
    return [name.strip() for layer in contract["layers"] for name in layer.split("|")]


def test_every_module_is_named_in_the_map() -> None:
    doc = edge_agent.__doc__ or ""
    missing = [
        _dotted(p)
        for p in _modules()
        if p != PACKAGE / "__init__.py" and f":mod:`{_dotted(p)}`" not in doc
    ]
    assert ":mod:`edge_agent.training`" in doc
    assert not missing, f"not on the map in edge_agent/__init__.py: {missing}"


def test_the_map_names_no_module_that_is_gone() -> None:
    doc = edge_agent.__doc__ or ""
    named = {part.split("`")[0].lstrip("~") for part in doc.split(":mod:`")[1:]}
    existing = {_dotted(p) for p in PACKAGE.rglob("*.py")}
    assert named - existing == set()


def test_the_top_level_stays_small() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def test_the_layers_contract_names_every_room_and_top_module() -> None:
    layers = set(_contract_layers())
    rooms = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert rooms | top == layers


def _own_imports_in_functions(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``edge_agent`` import inside a function of ``path``."""
    tree = ast.parse(path.read_text())
    found: list[tuple[int, str]] = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [(node.lineno, n) for n in names if n.split(".")[0] == "edge_agent"]
    return found


def _justified(lines: list[str], lineno: int) -> bool:
    """Whether a ``# heavy:`` comment sits in the comment block right above line ``lineno``."""
    index = lineno - 2
    while index >= 0 and lines[index].strip().startswith("#"):
        if lines[index].strip().startswith("# heavy:"):
            return True
        index -= 1
    return False


def test_no_own_module_import_inside_a_function_without_a_reason() -> None:
    hidden = []
    for path in _modules():
        lines = path.read_text().splitlines()
        for lineno, module in _own_imports_in_functions(path):
            if not _justified(lines, lineno):
                hidden.append(f"{path.relative_to(REPO)}:{lineno} {module}")
    assert not hidden, "in-function imports of our own modules:\n" + "\n".join(hidden)


def test_the_in_function_import_check_sees_one(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f():\n"
        "    from edge_agent.runtime import engine\n"
        "    # heavy: keeps onnxruntime off a light install\n"
        "    import edge_agent.serve.service\n"
        "    import json\n"
    )
    lines = sample.read_text().splitlines()
    found = _own_imports_in_functions(sample)
    assert found == [(2, "edge_agent.runtime"), (4, "edge_agent.serve.service")]
    assert [_justified(lines, n) for n, _ in found] == [False, True]
