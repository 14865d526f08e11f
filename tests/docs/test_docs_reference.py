"""The generated CLI and HTTP API references list every command and every route the code has.

The pages are rendered by the same MkDocs hook the site build runs
(``docs/hooks/fedshard_reference.py``), so a command or route added without reaching the
reference fails here, and so does a catalogue status the reference would not show.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from coordinator.errors import CapacityError, UnavailableError
from coordinator.http.errors import CATALOGUE, entry_of
from fedshard.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "docs" / "hooks" / "fedshard_reference.py"
MKDOCS = ROOT / "mkdocs.yml"


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    """The MkDocs hook module, loaded from its file as MkDocs loads it."""
    spec = importlib.util.spec_from_file_location("fedshard_reference", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def api_page(hook: ModuleType) -> str:
    page: str = hook.api_reference()
    return page


def test_every_cli_command_and_option_is_in_the_reference(hook: ModuleType) -> None:
    page = hook.cli_reference()
    names = [name for name, _ in hook.commands(build_parser())]
    assert {"fedshard agent", "fedshard coordinator", "fedshard plan", "fedshard lab up"} <= set(
        names
    )
    for name, parser in hook.commands(build_parser()):
        assert f"## `{name}`" in page, f"{name} is missing from the CLI reference"
        section = page.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in section, f"{name} {flag} is missing"


def test_every_route_is_in_the_api_reference(hook: ModuleType, api_page: str) -> None:
    with hook.coordinator_app() as app:
        found = hook.routes(app)
    assert ("POST", "/v1/chat/completions", True) in found
    assert ("POST", "/v1/training/runs", True) in found
    for method, path, in_schema in found:
        line = f"### `{method} {path}`" if in_schema else f"- `{method} {path}`"
        assert line in api_page, f"{method} {path} is missing from the HTTP API reference"


def test_the_reference_lists_every_catalogue_status(api_page: str) -> None:
    for kind, entry in CATALOGUE:
        row = re.search(rf"^\| `{kind.__name__}` \| (\d+) \|", api_page, re.MULTILINE)
        assert row is not None, f"{kind.__name__} is missing from the error catalogue page"
        assert int(row.group(1)) == entry.status


def test_a_full_session_table_is_429_and_a_lost_model_503() -> None:
    """The one answer README, wire table and catalogue must agree on (issue 41 item 7)."""
    assert entry_of(CapacityError("sessions full", 1.0)).status == 429
    assert entry_of(UnavailableError("device lost", 10.0)).status == 503


def test_every_generated_page_is_in_the_navigation(hook: ModuleType) -> None:
    nav = MKDOCS.read_text(encoding="utf-8")
    for page in ("reference/cli.md", "reference/http-api.md", "benchmarks.md"):
        assert page in nav
    assert "docs/hooks/fedshard_reference.py" in nav
