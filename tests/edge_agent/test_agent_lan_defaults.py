"""``fedshard agent`` on a LAN: the help says what it binds to by default and why, and the
wildcard address is refused (the agent advertises one address over mDNS)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.cli import config_from_args
from edge_agent.errors import ConfigError
from fedshard.cli import build_parser


def _agent_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["agent", "--name", "nas", "--memory", "64MiB", "--state-dir", str(tmp_path), *extra]


def test_help_states_the_default_interface_and_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["agent", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default 127.0.0.1: only this machine" in text
    assert "default 0: any free port" in text


def test_a_lan_address_is_taken_and_the_wildcard_refused(tmp_path: Path) -> None:
    lan = build_parser().parse_args(_agent_args(tmp_path, "--interface", "192.168.1.20"))
    assert config_from_args(lan).interface == "192.168.1.20"
    wildcard = build_parser().parse_args(_agent_args(tmp_path, "--interface", "0.0.0.0"))
    with pytest.raises(ConfigError, match="one address"):
        config_from_args(wildcard)
