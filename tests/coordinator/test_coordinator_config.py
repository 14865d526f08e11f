"""The coordinator's configuration: its command-line flags and its API token."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_coordinator_flags_build_the_training_and_cache_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fedshard coordinator --superlink-port`` sends API runs to paired agents."""
    from coordinator import app as service
    from coordinator.config import AgentTrainingConfig, CoordinatorConfig
    from fedshard.cli import build_parser

    seen: list[CoordinatorConfig] = []
    monkeypatch.setattr(service, "serve", lambda config, console: seen.append(config) or 0)
    base = ["coordinator", "--state-dir", str(tmp_path / "state"), "--port", "0"]
    extras: tuple[list[str], ...] = (
        [],
        ["--superlink-port", "9093", "--train-clients", "4", "--draft-threads", "3"],
    )
    for extra in extras:
        args = build_parser().parse_args([*base, *extra, "--segment-cache", str(tmp_path / "c")])
        assert args.run(args) == 0
    plain, agents = seen
    assert plain.agent_training is None
    assert plain.draft_threads == max(1, min(4, (os.cpu_count() or 1) // 2))
    assert agents.draft_threads == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--draft-threads", "0"])
    assert agents.agent_training == AgentTrainingConfig(superlink_port=9093, clients=4)
    assert agents.segment_cache_dir == tmp_path / "c"
    assert CoordinatorConfig(tmp_path).segment_cache_dir == tmp_path / "segment-cache"


def test_api_tokens_never_start_with_a_dash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fedshard pair --token -x...`` would read a leading-dash token as an option."""
    import secrets

    from coordinator.config import load_or_create_token

    minted = iter(["-starts-with-a-dash", "fine-token"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: next(minted))
    assert load_or_create_token(tmp_path) == "fine-token"
    assert load_or_create_token(tmp_path) == "fine-token"  # kept in the state dir
