"""``fedshard agent --train-data``: the flags, and the SuperNode that lives as long as the agent."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pytest

from edge_agent.cli import config_from_args, register
from edge_agent.errors import ConfigError
from protocols.training import TRAIN_DATA_FILE


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(argv)


def _base(tmp: Path) -> list[str]:
    return ["agent", "--name", "a", "--memory", "64MiB", "--state-dir", str(tmp / "state")]


def _data(tmp: Path) -> Path:
    data = tmp / "data"
    data.mkdir()
    np.savez(data / TRAIN_DATA_FILE, x=np.zeros((2, 1), np.float32), y=np.zeros(2, np.int64))
    return data


def _tls(tmp: Path) -> list[str]:
    return ["--ca", str(tmp / "ca.pem"), "--cert", str(tmp / "c.pem"), "--key", str(tmp / "k")]


def test_train_flags_build_the_training_config(tmp_path: Path) -> None:
    data = _data(tmp_path)
    train = ["--train-data", str(data), "--train-superlink", "127.0.0.1:9093"]
    train += ["--train-segments", str(tmp_path / "v1")]
    config = config_from_args(_parse(_base(tmp_path) + _tls(tmp_path) + train))
    assert config.training is not None
    assert config.training.budget_bytes == 64 << 20  # the agent's memory by default
    assert config.training.superlink == "127.0.0.1:9093"
    budget = config_from_args(
        _parse(_base(tmp_path) + _tls(tmp_path) + train + ["--train-budget", "1MiB"])
    )
    assert budget.training is not None and budget.training.budget_bytes == 1 << 20
    assert config_from_args(_parse(_base(tmp_path))).training is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--train-superlink", "127.0.0.1:1"], "need --train-data"),
        (["--train-data", "DATA"], "needs --train-superlink, --train-segments and --ca"),
        (
            ["--train-data", "EMPTY", "--train-superlink", "h:1", "--train-segments", "s"],
            "holds no data.npz",
        ),
    ],
)
def test_train_flags_are_checked(tmp_path: Path, extra: list[str], message: str) -> None:
    data = _data(tmp_path)
    (tmp_path / "empty").mkdir()
    extra = [
        str(data) if e == "DATA" else str(tmp_path / "empty") if e == "EMPTY" else e for e in extra
    ]
    with pytest.raises(ConfigError, match=message):
        config_from_args(_parse(_base(tmp_path) + _tls(tmp_path) + extra))


def test_the_agents_supernode_runs_until_the_agent_stops(tmp_path: Path) -> None:
    """It keeps waiting for a SuperLink that is not up yet, and is stopped with the agent."""
    pytest.importorskip("flwr")
    from edge_agent.training.supernode import agent_supernode

    data = _data(tmp_path)
    (tmp_path / "ca.pem").write_bytes(b"")
    argv = _base(tmp_path) + _tls(tmp_path)
    argv += ["--train-data", str(data), "--train-superlink", "127.0.0.1:9"]
    argv += ["--train-segments", str(tmp_path)]
    config = config_from_args(_parse(argv))
    with agent_supernode(config) as node:
        time.sleep(3.0)
        assert node.alive(), node.log_path.read_text(errors="replace")
        assert node.config.work_dir == (tmp_path / "state" / "training").resolve()
        assert node.config.data_dir == data.resolve()
    assert not node.alive()
