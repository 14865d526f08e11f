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
        (["--train-storage", "1GiB"], "need --train-data"),
        (["--train-data", "DATA"], "needs --train-superlink"),
        (
            ["--train-data", "EMPTY", "--train-superlink", "h:1", "--train-segments", "s"],
            "holds no data.npz, \\*.jsonl or \\*.txt",
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


def test_text_records_without_segments_or_ca_train_on_the_coordinators_copy(
    tmp_path: Path,
) -> None:
    """An unpaired agent with text records: no --ca, no --train-segments; its SuperNode reads
    the copy the coordinator sends (``training/current``) and waits for pairing's CA."""
    pytest.importorskip("flwr")
    from edge_agent.training.supernode import agent_supernode

    data = tmp_path / "text"
    data.mkdir()
    (data / "notes.txt").write_text("one record\nanother record\n")
    argv = [*_base(tmp_path), "--train-data", str(data), "--train-superlink", "127.0.0.1:9"]
    config = config_from_args(_parse([*argv, "--train-storage", "2MiB"]))
    assert config.training is not None and config.training.segments_dir is None
    assert config.training.storage_bytes == 2 << 20
    with agent_supernode(config) as node:
        work = (tmp_path / "state" / "training").resolve()
        assert node.config.segments_dir == work / "current"
        assert node.config.root_certificates == (tmp_path / "state" / "ca.pem").resolve()
        time.sleep(1.5)
        assert not node.alive(), "no SuperNode before the agent is paired"
        (tmp_path / "state" / "ca.pem").write_bytes(b"")  # what pairing leaves
        deadline = time.monotonic() + 10
        while not node.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert node.alive(), node.log_path.read_text(errors="replace")
        assert node.restarts == 0
    assert not node.alive()


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


def test_the_pairing_offer_carries_the_node_key_and_the_coordinator_registers_it(
    tmp_path: Path,
) -> None:
    """Agent: the offer has its node public key, the same the SuperNode's private key matches.
    Coordinator: pending request and paired device keep it; only paired devices' keys count."""
    from cryptography.hazmat.primitives import serialization

    from coordinator.trust.ca import CertificateAuthority
    from coordinator.trust.pairing import Pairing
    from edge_agent.config import AgentConfig
    from edge_agent.trust.identity import load_identity
    from edge_agent.trust.pairing import make_node_key, node_key_dir, pairing_offer
    from protocols.errors import SchemaError
    from protocols.pairing import CODE_FILE, PairingOffer

    state = tmp_path / "agent"
    offer = pairing_offer(load_identity(AgentConfig("cam-1", 1 << 20, state)))
    assert offer.node_public_key is not None
    assert offer.node_public_key.startswith("ecdsa-sha2-nistp256 ")
    again = pairing_offer(load_identity(AgentConfig("cam-1", 1 << 20, state)))
    assert again.node_public_key == offer.node_public_key  # made once, kept
    private, _ = make_node_key(node_key_dir(state))
    key = serialization.load_ssh_private_key(private.read_bytes(), password=None)
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    assert public.decode() == offer.node_public_key
    # the wire model refuses anything but an EC OpenSSH public key
    bad = offer.model_dump() | {"node_public_key": "ssh-rsa AAAA; rm -rf /"}
    with pytest.raises(SchemaError):
        PairingOffer.from_json(PairingOffer.model_construct(**bad).model_dump_json())

    ca = CertificateAuthority.open(tmp_path / "coordinator")
    pairing = Pairing(tmp_path / "coordinator", ca)
    pairing.request(offer.name, offer.csr_pem, offer.node_public_key, offer.commitment)
    code = (state / CODE_FILE).read_text().strip()
    assert pairing.node_keys() == {}  # pending devices are not registered
    pairing.approve("cam-1", code)
    assert pairing.node_keys() == {"cam-1": offer.node_public_key}
    reopened = Pairing(tmp_path / "coordinator", ca)  # survives a restart
    assert reopened.node_keys() == {"cam-1": offer.node_public_key}
    reopened.revoke("cam-1")
    assert reopened.node_keys() == {}


def test_a_run_on_agents_needs_as_many_node_keys_as_clients(tmp_path: Path) -> None:
    from coordinator.training.errors import TrainingRunError
    from coordinator.training.runner import TrainingTarget, agent_federation
    from coordinator.trust.ca import CertificateAuthority

    federation = agent_federation(
        CertificateAuthority.open(tmp_path), 1, lambda: {"a": "ecdsa-sha2-nistp256 AAAA"}
    )
    target = TrainingTarget(tmp_path, tmp_path / "t.npz", tmp_path / "v", population=3)
    expected = "1 paired agents have a node key; the run needs 3"
    with pytest.raises(TrainingRunError, match=expected), federation(tmp_path / "run", target):
        pass
