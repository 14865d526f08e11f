"""Docstring cross-references that name nothing, read from source with :mod:`ast` (nothing is
imported).

A docstring's Sphinx-style roles (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``,
``:data:``, ``:exc:``, ``:obj:``; with or without ``~``, a title ``text <target>`` or leading
dots) that name one of the given packages must resolve:

- a module is a ``.py`` file or a package directory;
- a name is defined at the top level of its module: a class, a function, an assignment or an
  import (a re-export, followed to where it is defined when it comes from one of the packages);
- ``Class.member`` is defined in the class body (a method, a field, a nested class, an enum
  member), as ``self.member`` in one of its methods, or in a base class of ours.

A target that names none of the packages, a builtin or another installed module (``Router``,
``Pairing.renew``) must be defined where the docstring sits: in its module or an enclosing
class. Leading dots work as in a relative import (``.backend`` in ``pkg/__init__.py`` is
``pkg.backend``; in ``pkg/a.py`` it is ``pkg.backend`` too); a single leading dot also finds a
name of the current module. Every bare string statement counts as a docstring (the module's,
a class's, a function's, an attribute's).

Run ``python -m devtools.docstring_refs PACKAGE_DIR...`` to list the stale references.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROLE = re.compile(r":(?:py:)?(mod|func|class|meth|attr|data|exc|obj):`([^`]+)`")
"""A role and its content (title and target, ``~`` or ``!`` and all)."""

MODULE_ROLES = frozenset({"mod", "obj"})
"""The roles whose target may be a module itself."""


@dataclass(frozen=True)
class StaleRef:
    """A cross-reference in a docstring whose target does not exist."""

    path: Path
    line: int
    role: str
    target: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: :{self.role}:`{self.target}`: {self.reason}"


@dataclass(frozen=True)
class Where:
    """Where a reference sits: its module and, for a docstring inside a class, the class."""

    module: str
    is_package: bool
    classes: tuple[str, ...]
    imported: frozenset[str] = frozenset()
    """Top-level names of the modules the file imports anywhere (``torch``, ``onnxruntime``)."""


def stale_refs(package_dirs: list[Path]) -> list[StaleRef]:
    """Stale cross-references in the docstrings of every module under ``package_dirs``.

    The directories must share a parent (the repository root); references naming any of the
    packages are checked, others (the standard library, third parties) are not.
    """
    if not package_dirs:
        return []
    root = package_dirs[0].parent
    own = frozenset(p.name for p in package_dirs)
    found: list[StaleRef] = []
    for package in package_dirs:
        for path in sorted(package.rglob("*.py")):
            found.extend(_stale_in_file(Path(root), own, path))
    return found


def _stale_in_file(root: Path, own: frozenset[str], path: Path) -> Iterator[StaleRef]:
    parts = path.relative_to(root).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    module = ".".join(parts[:-1] if is_package else parts)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = frozenset(_imported_modules(tree))
    for text, line, classes in _docstrings(tree):
        where = Where(module, is_package, classes, imported)
        for match in ROLE.finditer(text):
            role, content = match.group(1), match.group(2)
            target = _target(content)
            reason = _check(root, own, where, role, target)
            if reason is not None:
                at = line + text.count("\n", 0, match.start())
                yield StaleRef(path, at, role, target, reason)


def _docstrings(
    tree: ast.AST, classes: tuple[str, ...] = ()
) -> Iterator[tuple[str, int, tuple[str, ...]]]:
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
            if isinstance(child.value.value, str):
                yield child.value.value, child.lineno, classes
        elif isinstance(child, ast.ClassDef):
            yield from _docstrings(child, (*classes, child.name))
        else:
            yield from _docstrings(child, classes)


def _target(content: str) -> str:
    titled = re.fullmatch(r".*<([^<>]+)>\s*", content, flags=re.DOTALL)
    target = titled.group(1) if titled else content
    return target.strip().lstrip("~!").removesuffix("()")


def _check(root: Path, own: frozenset[str], where: Where, role: str, target: str) -> str | None:
    """Why ``target`` does not resolve from ``where``, or None when it does (or is not ours)."""
    if target.startswith("."):
        return _check_relative(root, where, role, target)
    first = target.split(".")[0]
    if first in own:
        return _resolve(root, role, target)
    if role == "mod" or first in where.imported or _elsewhere(first):
        return None
    if _check_relative(root, where, role, "." + target) is None:
        return None
    return "not defined here: qualify it (package.module.name)"


def _imported_modules(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def _elsewhere(name: str) -> bool:
    """Whether ``name`` is a builtin or a module outside the project (found, not imported)."""
    if hasattr(builtins, name) or name in sys.stdlib_module_names:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _check_relative(root: Path, where: Where, role: str, target: str) -> str | None:
    dots = len(target) - len(target.lstrip("."))
    rest = target[dots:]
    package = where.module.split(".")
    if not where.is_package:
        package = package[:-1]
    base = package[: len(package) - (dots - 1)] if dots <= len(package) else []
    reason = _resolve(root, role, ".".join([*base, rest])) if base else "above the top package"
    if reason is None or dots > 1:
        return reason
    scopes = [".".join([where.module, *where.classes[:i]]) for i in range(len(where.classes) + 1)]
    if any(_resolve(root, role, f"{scope}.{rest}") is None for scope in scopes):
        return None
    return reason


def _resolve(root: Path, role: str, target: str) -> str | None:
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        if _module_file(root, tuple(parts[:cut])) is not None:
            rest = parts[cut:]
            break
    else:
        return f"no module {parts[0]}"
    module = ".".join(parts[:cut])
    if not rest:
        return None if role in MODULE_ROLES else f"{module} is a module"
    if role == "mod":
        return f"no module {module}.{rest[0]}"
    return _resolve_names(root, parts[:cut], rest, depth=0)


def _resolve_names(root: Path, module: list[str], names: list[str], depth: int) -> str | None:
    dotted = ".".join(module)
    if depth > 8:
        return f"re-exports of {dotted} go round"
    if _module_file(root, tuple(module)) is None:
        return f"no module {dotted}"
    defined = _top_level_cached(root, tuple(module))
    first = names[0]
    if first not in defined:
        if _module_file(root, (*module, first)) is not None:
            return (
                _resolve_names(root, [*module, first], names[1:], depth + 1) if names[1:] else None
            )
        return f"{dotted} defines no {first}"
    node = defined[first]
    if isinstance(node, tuple):
        source, name = node
        if source[0] != module[0] and _module_file(root, source) is None:
            return None
        if _module_file(root, source) is None:
            return f"{dotted} imports {first} from {'.'.join(source)}, which is not a module"
        return _resolve_names(root, list(source), [name, *names[1:]], depth + 1)
    if len(names) == 1:
        return None
    if not isinstance(node, ast.ClassDef):
        return f"{dotted}.{first} is not a class"
    return _resolve_member(root, module, node, names[1:], depth)


def _resolve_member(
    root: Path, module: list[str], cls: ast.ClassDef, names: list[str], depth: int
) -> str | None:
    members = _class_members(cls)
    name = names[0]
    if name in members:
        inner = members[name]
        if len(names) == 1:
            return None
        if isinstance(inner, ast.ClassDef):
            return _resolve_member(root, module, inner, names[1:], depth)
        return f"{cls.name}.{name} is not a class"
    for base in cls.bases:
        if isinstance(base, ast.Name) and depth < 8:
            found = _base_class(root, module, base.id)
            if found is not None and _resolve_member(root, *found, names, depth + 1) is None:
                return None
    return f"{'.'.join(module)}.{cls.name} has no member {name}"


def _base_class(root: Path, module: list[str], name: str) -> tuple[list[str], ast.ClassDef] | None:
    for _ in range(8):
        node = _top_level_cached(root, tuple(module)).get(name)
        if isinstance(node, ast.ClassDef):
            return module, node
        if not isinstance(node, tuple) or _module_file(root, node[0]) is None:
            return None
        module, name = list(node[0]), node[1]
    return None


def _class_members(cls: ast.ClassDef) -> dict[str, ast.AST]:
    members: dict[str, ast.AST] = {}
    for statement in cls.body:
        members.update(_defines(statement))
    for node in ast.walk(cls):
        if _is_self_attribute(node) and isinstance(node, ast.Attribute):
            members.setdefault(node.attr, node)
    return members


def _is_self_attribute(node: ast.AST) -> bool:
    """``self.name`` as an assignment's target."""
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


Defined = dict[str, ast.AST | tuple[tuple[str, ...], str]]
"""Names a module defines: their nodes, or (module, name) for what it imports by name."""


@cache
def _top_level_cached(root: Path, module: tuple[str, ...]) -> Defined:
    return _top_level(root, list(module))


def _top_level(root: Path, module: list[str]) -> Defined:
    """Names a module defines at top level (in ``if`` and ``try`` blocks too); none when there
    is no such module."""
    path = _module_file(root, tuple(module))
    if path is None:
        return {}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined: Defined = {}
    package = module if path.name == "__init__.py" else module[:-1]
    for node in _top_statements(tree.body):
        if isinstance(node, ast.ImportFrom):
            source = _import_source(node, package)
            for alias in node.names:
                defined[alias.asname or alias.name] = (source, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                defined[name] = node
        else:
            for name, at in _defines(node):
                defined[name] = at
    return defined


def _top_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_statements(node.body)
            yield from _top_statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _top_statements(block)
            for handler in node.handlers:
                yield from _top_statements(handler.body)
        else:
            yield node


def _defines(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        yield node.name, node
    elif isinstance(node, ast.Assign):
        for target in node.targets:
            yield from ((n.id, node) for n in ast.walk(target) if isinstance(n, ast.Name))
    elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
        yield node.target.id, node


def _import_source(node: ast.ImportFrom, package: list[str]) -> tuple[str, ...]:
    """The module a ``from ... import`` reads, ``package`` being the importer's package."""
    named = tuple(node.module.split(".")) if node.module else ()
    if node.level == 0:
        return named
    return (*package[: len(package) - node.level + 1], *named)


@cache
def _module_file(root: Path, parts: tuple[str, ...]) -> Path | None:
    path = root.joinpath(*parts)
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def main(argv: list[str]) -> int:
    """List the stale docstring cross-references under each package directory given."""
    found = stale_refs([Path(arg).resolve() for arg in argv])
    for ref in found:
        print(ref)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
