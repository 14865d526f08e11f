"""``fedshard coordinator`` on a LAN: what it binds to unless told, what it refuses, and the
ports it tells the operator to open (issue 41 item 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator import app as service
from coordinator.config import (
    AgentTrainingConfig,
    CoordinatorConfig,
    binding_problem,
)
from fedshard.cli import build_parser


def _help(command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_says_what_it_binds_to_and_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _help("coordinator", capsys, monkeypatch)
    assert "default 127.0.0.1: only this machine" in text
    assert "--all-interfaces" in text
    assert "refused without an API token" in text


def test_the_wildcard_needs_its_own_flag_and_a_token() -> None:
    assert binding_problem("127.0.0.1", False, "t") is None
    assert binding_problem("192.168.1.10", True, "t") is None
    assert "--all-interfaces" in (binding_problem("0.0.0.0", False, "t") or "")
    assert "token" in (binding_problem("192.168.1.10", True, "") or "")


def test_all_interfaces_serves_the_api_everywhere_and_browses_on_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[CoordinatorConfig] = []

    def serve(config: CoordinatorConfig, console: object) -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(service, "serve", serve)
    base = ["coordinator", "--state-dir", str(tmp_path / "state"), "--port", "0"]
    refused = build_parser().parse_args([*base, "--interface", "0.0.0.0"])
    assert refused.run(refused) == 2
    assert seen == []
    args = build_parser().parse_args([*base, "--interface", "10.0.0.2", "--all-interfaces"])
    assert args.run(args) == 0
    (config,) = seen
    assert config.api_host == "0.0.0.0"
    assert config.interface == "10.0.0.2"
    assert CoordinatorConfig(tmp_path).api_host == "127.0.0.1"


def test_the_firewall_lines_name_every_port() -> None:
    plain = CoordinatorConfig(Path("s"), "192.168.1.10", 8470)
    lines = "\n".join(plain.firewall_ports())
    assert "tcp 8470 on 192.168.1.10" in lines
    assert "udp 5353" in lines
    assert "SuperLink" not in lines
    training = CoordinatorConfig(Path("s"), "192.168.1.10", 8470, "t", AgentTrainingConfig(9093))
    assert "tcp 9093" in "\n".join(training.firewall_ports())
