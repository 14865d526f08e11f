"""The edge agent's rooms: every module is on the map, the layers contract names every room,
and at most 8 modules at the top. No own-module import hides inside a function:
``tests/devtools/test_import_hygiene.py`` checks that for every package.

The map check is :mod:`devtools.import_hygiene`'s. ``edge_agent/training/`` is its
own room with its own map (``edge_agent/training/__init__.py``); the top map names the room.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import edge_agent
from devtools.import_hygiene import package_modules, unmapped_modules

PACKAGE = Path(edge_agent.__file__).parent
REPO = PACKAGE.parent
TRAINING = "edge_agent.training"
CONTRACT = "edge_agent rooms: each imports only the rooms below it"


def _outside_training(module: str) -> bool:
    return not module.startswith(TRAINING + ".")


def test_every_module_is_named_in_the_map() -> None:
    assert [m for m in unmapped_modules(PACKAGE) if _outside_training(m)] == []
    assert "edge_agent.runtime.engine" in package_modules(PACKAGE)


def test_the_map_names_no_module_that_is_gone() -> None:
    doc = edge_agent.__doc__ or ""
    named = {part.split("`")[0].lstrip("~") for part in doc.split(":mod:`")[1:]}
    assert named - set(package_modules(PACKAGE)) == set()


def test_the_top_level_stays_small() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def test_the_layers_contract_names_every_room_and_top_module() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"] == CONTRACT]
    assert contract["type"] == "layers"
    assert contract["containers"] == ["edge_agent"]
    layers = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    rooms = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert layers == rooms | top
