"""Finding every implementation of an interface, for the contract suites
(``tests/coordinator/test_contract_*.py``): a suite parametrised over a list of
implementations also checks that the list is complete."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Sequence


def implementations(package: str, members: Sequence[str]) -> set[type]:
    """The classes defined in ``package`` and its modules that have every one of ``members``
    (a structural Protocol has no registry of its implementations)."""
    root = importlib.import_module(package)
    modules = [root]
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        modules.append(importlib.import_module(info.name))
    found: set[type] = set()
    for module in modules:
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or getattr(cls, "_is_protocol", False):
                continue
            if all(hasattr(cls, member) for member in members):
                found.add(cls)
    return found
