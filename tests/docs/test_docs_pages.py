"""The README and the documentation pages stay true to the repository (issue 41).

- the README is a front page: at most 200 lines, no dated measurements;
- every relative link of the README points at a file that exists;
- every repository path a page names in backticks exists, every test file it names by basename
  exists somewhere under tests/, and every dotted module path it names imports.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
PACKAGES = ("tests", "bench", "devtools", "coordinator", "edge_agent", "partitioner", "protocols")
REPO_PATH = re.compile(rf"`((?:{'|'.join(PACKAGES)}|docs|hostkit|fedshard)/[A-Za-z0-9_./-]+)`")
TEST_FILE = re.compile(r"`(test_[a-z0-9_]+\.py)`")
MODULE = re.compile(
    r"`((?:devtools|coordinator|edge_agent|partitioner|protocols|hostkit)(?:\.\w+)+)`"
)
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_the_readme_is_a_front_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert DATED.search(text) is None, "dated measurements belong in bench/results/"


def test_the_readmes_relative_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert links
    for link in links:
        assert (ROOT / link).exists(), f"README links to a missing {link}"


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_and_module_exists(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    tests = {path.name for path in (ROOT / "tests").rglob("test_*.py")}
    for path in REPO_PATH.findall(text):
        assert (ROOT / path.rstrip("/")).exists(), f"{page.name} names a missing {path}"
    for name in TEST_FILE.findall(text):
        assert name in tests, f"{page.name} names a missing test {name}"
    for name in MODULE.findall(text):
        assert _resolves(name), f"{page.name} names {name}, which does not import"
