"""Every module of every package is named in a package map.

A map is a package's ``__init__`` docstring: it names each module as ``:mod:`dotted.name``` with
a one-line purpose. A module may be named by its package's map or by the map of any package that
encloses it (``coordinator.training.lora`` maps its own modules). The packages are
import-linter's root packages (``pyproject.toml``), so a new package is covered the day it joins
the contracts; the check is :func:`devtools.import_hygiene.unmapped_modules`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from devtools.import_hygiene import package_modules, unmapped_modules

REPO = Path(__file__).resolve().parents[2]
PACKAGES = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"][
    "root_packages"
]


def test_every_package_of_the_project_is_checked() -> None:
    assert set(PACKAGES) >= {
        "protocols",
        "hostkit",
        "partitioner",
        "edge_agent",
        "coordinator",
        "devtools",
        "fedshard",
    }


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_named_in_a_map(package: str) -> None:
    assert len(package_modules(REPO / package)) > 1
    unmapped = unmapped_modules(REPO / package)
    assert unmapped == [], f"modules no map of {package} names:\n" + "\n".join(unmapped)


def test_a_module_is_mapped_by_an_enclosing_map_only(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "room").mkdir(parents=True)
    (package / "other").mkdir()
    (package / "__init__.py").write_text(
        '"""Map.\n\n- :mod:`pkg.room`  a room\n- :mod:`pkg.other`  another\n"""\n'
    )
    (package / "room" / "__init__.py").write_text('"""Room.\n\n- :mod:`~pkg.room.a`  a\n"""\n')
    (package / "other" / "__init__.py").write_text('"""Other: names :mod:`pkg.room.b`."""\n')
    for name in ("a", "b"):
        (package / "room" / f"{name}.py").write_text("")
    (package / "other" / "c.py").write_text('"""Names itself: :mod:`pkg.other.c`."""\n')

    assert unmapped_modules(package) == ["pkg.other.c", "pkg.room.b"]
