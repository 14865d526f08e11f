"""Every cross-reference in a docstring resolves, in every package of the project.

A Sphinx-style role (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``, ``:data:``,
``:exc:``, ``:obj:``) naming one of import-linter's root packages (``pyproject.toml``) must name
a module that exists, a name its module defines, or a member of a class that exists
(:func:`devtools.docstring_refs.stale_refs`, which reads the source and imports nothing). A
name that is neither ours, a builtin nor an installed module must be defined where it is used.
"""

from __future__ import annotations

import tomllib
from functools import cache
from pathlib import Path

import pytest

from devtools.docstring_refs import StaleRef, main, stale_refs

REPO = Path(__file__).resolve().parents[2]
PACKAGES: list[str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"][
    "root_packages"
]


@cache
def _project_refs() -> tuple[StaleRef, ...]:
    return tuple(stale_refs([REPO / package for package in PACKAGES]))


@pytest.mark.parametrize("package", PACKAGES)
def test_every_cross_reference_resolves(package: str) -> None:
    stale = [str(r) for r in _project_refs() if (REPO / package) in r.path.parents]
    assert stale == [], "stale docstring cross-references:\n" + "\n".join(stale)


MAP = '''"""The map.

- :mod:`pkg.a`  a module
- :mod:`~pkg.gone`  a module that was moved away
- :mod:`ast`  not ours: not checked
"""
'''

A = '''"""Module a: :class:`~pkg.a.A`, :meth:`pkg.a.A.m`, :attr:`pkg.a.A.x`, :data:`pkg.a.CONST`.

Through a re-export: :meth:`pkg.a.Bee.n`; from a base class: :meth:`pkg.a.C.m`; relative:
:class:`.b.B`, :func:`.f`; titled: :class:`the A <pkg.a.A>`; here: :meth:`A.m`, :data:`Bee`.
Stale: :meth:`pkg.a.A.gone`, :func:`pkg.a.missing`, :func:`pkg.b`, :mod:`pkg.a.A`,
:class:`.lost`, :class:`an old name <pkg.a.Nope>`, :class:`Gone` (defined nowhere here).
Not ours, not checked: :class:`pathlib.Path`, :exc:`ValueError`, :mod:`somewhere`.
"""

from pkg.b import B as Bee

CONST = 1
"""A constant; :data:`CONST` is not qualified and not checked."""


class A:
    """See :attr:`.y`, a field, and :meth:`.m`."""

    y: int = 0

    def __init__(self) -> None:
        self.x = 1

    def m(self) -> None:
        """Inside a method: :func:`pkg.a.f` resolves, :func:`pkg.b.g` does not."""


class C(A):
    pass


def f() -> None:
    pass
'''

B = '''"""Module b."""


class B:
    def n(self) -> None:
        pass
'''


def _fixture(root: Path) -> Path:
    package = root / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text(MAP)
    (package / "a.py").write_text(A)
    (package / "b.py").write_text(B)
    return package


def test_a_stale_reference_is_caught(tmp_path: Path) -> None:
    package = _fixture(tmp_path)

    found = [(r.path.name, r.line, r.role, r.target) for r in stale_refs([package])]

    assert found == [
        ("__init__.py", 4, "mod", "pkg.gone"),
        ("a.py", 5, "meth", "pkg.a.A.gone"),
        ("a.py", 5, "func", "pkg.a.missing"),
        ("a.py", 5, "func", "pkg.b"),
        ("a.py", 5, "mod", "pkg.a.A"),
        ("a.py", 6, "class", ".lost"),
        ("a.py", 6, "class", "pkg.a.Nope"),
        ("a.py", 6, "class", "Gone"),
        ("a.py", 25, "func", "pkg.b.g"),
    ]


def test_the_reasons_say_what_is_missing(tmp_path: Path) -> None:
    package = _fixture(tmp_path)

    reasons = {r.target: r.reason for r in stale_refs([package])}

    assert reasons["pkg.gone"] == "no module pkg.gone"
    assert reasons["pkg.a.A.gone"] == "pkg.a.A has no member gone"
    assert reasons["pkg.a.missing"] == "pkg.a defines no missing"
    assert reasons["pkg.b"] == "pkg.b is a module"
    assert reasons["pkg.a.A"] == "no module pkg.a.A"
    assert reasons["pkg.b.g"] == "pkg.b defines no g"
    assert reasons["Gone"] == "not defined here: qualify it (package.module.name)"


def test_the_command_lists_them_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    package = _fixture(tmp_path)

    assert main([str(package)]) == 1
    assert "a.py:5: :meth:`pkg.a.A.gone`: pkg.a.A has no member gone" in capsys.readouterr().out
    (package / "__init__.py").write_text('"""Only :mod:`pkg.a`."""\n')
    (package / "a.py").write_text('"""Only :class:`pkg.b.B`."""\n')
    assert main([str(package)]) == 0
