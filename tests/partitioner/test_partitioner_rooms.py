"""The partitioner's rooms stay mapped.

Every module under ``partitioner/`` is named in the package map (``partitioner/__init__.py``);
the check is :mod:`devtools.import_hygiene`'s. No own-module import hides inside a function:
``tests/devtools/test_import_hygiene.py`` checks that for every package.
"""

from __future__ import annotations

from pathlib import Path

import partitioner
from devtools.import_hygiene import package_modules, unmapped_modules

PACKAGE = Path(partitioner.__file__).parent


def test_every_module_is_named_in_the_package_map() -> None:
    assert unmapped_modules(PACKAGE) == []
    assert "partitioner.planning.planner" in package_modules(PACKAGE)
