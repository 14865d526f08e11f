"""The install extras cover what the training code imports (top-level and inside functions)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OURS = {"protocols", "partitioner", "edge_agent", "coordinator", "devtools", "hostkit", "fedshard"}


def _imports(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in OURS and n not in sys.stdlib_module_names}


def _key(requirement: str) -> tuple[str, set[str]]:
    match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", requirement)
    assert match is not None, requirement
    extras = {e.strip() for e in (match.group(2) or "").split(",") if e.strip()}
    return re.sub(r"[-_.]+", "-", match.group(1)).lower(), extras


def _closure(extras: list[str]) -> set[str]:
    """Distributions a ``fedshard[extras]`` install brings, following installed metadata."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [r for e in extras for r in project["optional-dependencies"][e]]
    todo += project.get("dependencies", [])
    seen: set[str] = set()
    while todo:
        name, wanted = _key(todo.pop())
        if name == "fedshard":
            todo += [r for e in wanted for r in project["optional-dependencies"][e]]
            continue
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            marker = req.split(";", 1)[1] if ";" in req else ""
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
            if extra is None or extra.group(1) in wanted:
                todo.append(req.split(";", 1)[0])
    return seen


def _distributions(module: str) -> set[str]:
    return {re.sub(r"[-_.]+", "-", d).lower() for d in metadata.packages_distributions()[module]}


@pytest.mark.parametrize(
    ("extras", "files"),
    [
        (["agent", "train"], sorted((REPO / "edge_agent" / "training").glob("*.py"))),
        (["coordinator"], [REPO / "coordinator" / "training" / "accounting.py"]),
        (
            ["coordinator", "train"],
            [
                *sorted((REPO / "coordinator" / "training").glob("*.py")),
                REPO / "partitioner" / "models" / "lora.py",
            ],
        ),
    ],
)
def test_extras_cover_the_imports(extras: list[str], files: list[Path]) -> None:
    installed = _closure(extras)
    missing = {m for m in _imports(files) if not _distributions(m) & installed}
    assert not missing, f"fedshard[{','.join(extras)}] lacks {sorted(missing)}"


def test_the_coordinators_accountant_dependency_is_installed_by_its_extra() -> None:
    assert "dp-accounting" in _closure(["coordinator"])
