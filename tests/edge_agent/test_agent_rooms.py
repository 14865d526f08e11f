"""The edge agent's rooms: the map names no module that is gone, the layers contract names every
room, and at most 8 modules at the top. That every module is on a map, and that no own-module
import hides inside a function, ``tests/devtools/test_package_maps.py`` and
``tests/devtools/test_import_hygiene.py`` check for every package.

``edge_agent/training/`` is its own room with its own map (``edge_agent/training/__init__.py``);
the top map names the room.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import edge_agent
from devtools.import_hygiene import package_modules

PACKAGE = Path(edge_agent.__file__).parent
REPO = PACKAGE.parent
CONTRACT = "edge_agent rooms: each imports only the rooms below it"


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
