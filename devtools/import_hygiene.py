"""Import hygiene of a package, read from its source with :mod:`ast` (nothing is imported).

Two checks any package can run (``tests/devtools/test_import_hygiene.py`` runs the first on
every package of the project; the partitioner's and the edge agent's rooms tests the second):

- :func:`hidden_imports`: own-module imports inside a function. Each is an arrow no
  import-linter contract sees at import time and a circle waiting to happen. One is allowed
  only where it keeps a heavy optional dependency (onnx, torch, transformers, Flower) off a
  light import, and then says so with a ``# heavy:`` comment on the import or the line above.
- :func:`unmapped_modules`: modules no package map (the ``__init__`` docstring of the package
  or of a sub-package enclosing them) names as ``:mod:`dotted.name```.

Run ``python -m devtools.import_hygiene PACKAGE_DIR`` to list both.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HEAVY_MARK = "# heavy:"
"""What a justified in-function import carries (on its lines or the line above)."""


@dataclass(frozen=True)
class HiddenImport:
    """An own-module import inside a function."""

    path: Path
    line: int
    function: str
    statement: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.function}(): {self.statement}"


def package_modules(package_dir: Path) -> list[str]:
    """Dotted names of the package and every module and sub-package under ``package_dir``
    (``__init__.py`` names its package), sorted."""
    root = package_dir.parent
    names = set()
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(names)


def unmapped_modules(package_dir: Path) -> list[str]:
    """Modules under ``package_dir`` that no map names as ``:mod:`dotted.name``` (or
    ``:mod:`~dotted.name```): a map is the ``__init__`` docstring of the package or of any
    sub-package that encloses the module (the package itself needs no entry)."""
    root = package_dir.parent
    maps: dict[str, str] = {}
    for init in package_dir.rglob("__init__.py"):
        name = ".".join(init.relative_to(root).parent.parts)
        maps[name] = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    return [
        m
        for m in package_modules(package_dir)
        if m != package_dir.name and not _named_in_a_map(m, maps)
    ]


def _named_in_a_map(module: str, maps: dict[str, str]) -> bool:
    parts = module.split(".")
    enclosing = (".".join(parts[:i]) for i in range(1, len(parts)))
    marks = (f":mod:`{module}`", f":mod:`~{module}`")
    return any(mark in maps.get(p, "") for p in enclosing for mark in marks)


def hidden_imports(package_dir: Path, mark: str = HEAVY_MARK) -> list[HiddenImport]:
    """Own-module imports inside functions under ``package_dir`` that do not carry ``mark``.

    "Own" means the package's top-level name or a relative import. Imports under ``if
    TYPE_CHECKING:`` at module level are not inside a function and are not listed.
    """
    found: list[HiddenImport] = []
    for path in sorted(package_dir.rglob("*.py")):
        found.extend(_hidden_in_file(path, package_dir.name, mark))
    return found


def _hidden_in_file(path: Path, own: str, mark: str) -> Iterator[HiddenImport]:
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    for function, node in _imports_in_functions(ast.parse(source)):
        if not _is_own(node, own):
            continue
        around = lines[max(node.lineno - 2, 0) : node.end_lineno or node.lineno]
        if any(mark in line for line in around):
            continue
        statement = " ".join(lines[node.lineno - 1].split())
        yield HiddenImport(path, node.lineno, function, statement)


def _imports_in_functions(
    tree: ast.AST, function: str | None = None
) -> Iterator[tuple[str, ast.Import | ast.ImportFrom]]:
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _imports_in_functions(child, child.name)
        elif function is not None and isinstance(child, ast.Import | ast.ImportFrom):
            yield function, child
        else:
            yield from _imports_in_functions(child, function)


def _is_own(node: ast.Import | ast.ImportFrom, own: str) -> bool:
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        return node.level > 0 or module == own or module.startswith(own + ".")
    return any(a.name == own or a.name.startswith(own + ".") for a in node.names)


def main(argv: list[str]) -> int:
    """List the hidden imports and unmapped modules of each package directory given."""
    bad = 0
    for arg in argv:
        package = Path(arg)
        for hidden in hidden_imports(package):
            print(f"hidden import: {hidden}")
            bad += 1
        for module in unmapped_modules(package):
            print(f"not in the map of {package}/__init__.py: {module}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
