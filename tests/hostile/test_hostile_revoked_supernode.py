"""Hostile LAN, second round: a device revoked during a training run leaves the SuperLink.

A revoked device kept its SuperNode key on the running SuperLink, so its SuperNode kept taking
part. Now a SuperLink started for paired agents watches the pairing book and unregisters the
node of a device whose key left it. The unit test drives the watcher with fakes; the other
starts a real SuperLink (node authentication on, 127.0.0.1) and asks it which nodes it holds.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from coordinator_helpers import wait_for

from coordinator.training.flower import CONNECTION, SuperLink, flower_bin, make_node_key
from coordinator.training.revoked_nodes import RevokedNodes
from coordinator.training.runner import paired_superlink
from coordinator.trust.ca import CertificateAuthority

pytestmark = pytest.mark.timeout(180)


def test_the_node_of_a_device_whose_key_left_the_book_is_unregistered_once() -> None:
    book = {"a": "key-a", "b": "key-b", "c": "key-c"}
    unregistered: list[int] = []
    nodes = RevokedNodes(
        {"a": ("key-a", 1), "b": ("key-b", 2), "c": ("key-c", 3)}, lambda: book, unregistered.append
    )
    assert nodes.check() == []
    del book["b"]  # revoked
    book["c"] = "key-c2"  # paired again with another key: the old node must go too
    assert nodes.check() == ["b", "c"]
    assert nodes.check() == []
    assert unregistered == [2, 3]


def test_a_failed_unregister_is_tried_again() -> None:
    calls: list[int] = []

    def flaky(node_id: int) -> None:
        calls.append(node_id)
        if len(calls) == 1:
            raise RuntimeError("SuperLink busy")

    nodes = RevokedNodes({"a": ("key-a", 7)}, dict, flaky)
    with pytest.raises(RuntimeError):
        nodes.check()
    assert nodes.check() == ["a"]
    assert calls == [7, 7]


def _statuses(link: SuperLink) -> list[str]:
    """The status of every node the SuperLink lists, sorted."""
    cmd = [flower_bin("flwr"), "supernode", "list", CONNECTION, "--format", "json"]
    out = subprocess.run(cmd, env=link.env(), capture_output=True, timeout=60, check=False)
    reply = json.loads(out.stdout.decode(errors="replace"))
    assert reply.get("success"), reply
    return sorted(str(n["status"]) for n in reply["nodes"])


def test_revoking_a_device_removes_its_node_from_a_running_superlink(tmp_path: Path) -> None:
    ca = CertificateAuthority.open(tmp_path / "ca")
    keys = {}
    for name in ("a", "b"):
        _, public = make_node_key(tmp_path / "keys" / name)
        keys[name] = public.read_text().strip()
    book = dict(keys)
    with paired_superlink(tmp_path / "run", ca, keys, 2, current=lambda: book) as link:
        assert _statuses(link) == ["registered", "registered"]
        del book["b"]
        assert wait_for(lambda: _statuses(link) == ["registered", "unregistered"], 10.0)
