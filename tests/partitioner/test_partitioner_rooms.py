"""The partitioner's rooms stay mapped and its imports stay visible.

Every module under ``partitioner/`` is named in the package map (``partitioner/__init__.py``),
and no own-module import hides inside a function unless it keeps a heavy dependency off a light
import and says so (``# heavy:``). The checks are :mod:`devtools.import_hygiene`'s; the second
test shows they can fail.
"""

from __future__ import annotations

from pathlib import Path

import partitioner
from devtools.import_hygiene import hidden_imports, package_modules, unmapped_modules

PACKAGE = Path(partitioner.__file__).parent


def test_every_module_is_named_in_the_package_map() -> None:
    assert unmapped_modules(PACKAGE) == []
    assert "partitioner.planning.planner" in package_modules(PACKAGE)


def test_no_own_module_import_hides_inside_a_function() -> None:
    hidden = [str(h) for h in hidden_imports(PACKAGE)]
    assert hidden == [], "own-module imports inside functions without '# heavy:':\n" + "\n".join(
        hidden
    )


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "room").mkdir(parents=True)
    (package / "__init__.py").write_text('"""Map.\n\n- :mod:`pkg.room`  a room\n"""\n')
    (package / "room" / "__init__.py").write_text("")
    (package / "room" / "a.py").write_text(
        "import os\n"
        "from pkg.room import b\n\n"
        "def f() -> None:\n"
        "    from pkg.room import b\n"
        "    # heavy: keeps torch off a light import\n"
        "    from pkg.room import c\n"
        "    from . import d\n"
        "    import json\n"
    )
    (package / "room" / "b.py").write_text("")

    assert unmapped_modules(package) == ["pkg.room.a", "pkg.room.b"]
    found = [(h.line, h.function, h.statement) for h in hidden_imports(package)]
    assert found == [(5, "f", "from pkg.room import b"), (8, "f", "from . import d")]
