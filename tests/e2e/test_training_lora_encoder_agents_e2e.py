"""Contrastive LoRA of the served MiniLM on the paired agents' own SuperNodes: the pairs never
leave the devices.

A coordinator started with ``--superlink-port`` and three agents started unpaired with
``--train-data DIR`` (WordNet ``{"anchor", "positive"}`` pairs, one lexicographer domain each:
non-IID) and ``--train-superlink``, paired with their codes; ``fedshard export minilm --pooled``
is served on them (planning caps of 70 MB per agent, as in the local encoder e2e test). ``POST
/v1/training/runs {"model": ID, "method": "lora", "secure_aggregation": true, "dp": true}``:
the coordinator sends each agent the served version, and one SecAgg+ round of the contrastive
objective (in-batch negatives) with record-level DP runs on the agents' SuperNodes, with the
coordinator's encoder defaults (query and value, batch 64, 4 local epochs). Asserted: the run
finishes with held-out recall@1 before and after (the devices' mean, from the SecAgg+
aggregate),
epsilon per device at most 8, each agent trained on exactly the served version, the merged
version is rolled out live and ``/v1/embeddings`` answers from it with changed unit-norm
embeddings, and no pair's text is anywhere in the coordinator's state dir or log, nor in
another agent's.
"""

from __future__ import annotations

import filecmp
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from generation_lab import GenLab, decoder_lab
from test_training_lora_agents_e2e import _files_holding
from test_training_lora_e2e import finished_run
from test_training_lora_encoder_e2e import CAP, MODEL_ID, TEXTS, _active, _embed

from coordinator.deploy.store import segment_dir
from coordinator.training.flower import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

DOMAINS = (("noun.animal",), ("noun.food",), ("noun.plant",))
PER_DEVICE = 300
"""Pairs per device: some 270 train (batch 64 samples a quarter of them a step, which keeps
epsilon under 8 after four epochs) and 84 in all are held out."""


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """One WordNet share of pairs per device, outside every state dir."""
    from devtools.wordnet import write_shares

    return write_shares(tmp_path_factory.mktemp("pairs"), DOMAINS, PER_DEVICE, pairs=True)


@pytest.fixture(scope="module")
def lab(
    minilm_onnx: Path, pair_dirs: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GenLab]:
    from partitioner.models.packaged import minilm_dir

    tmp = tmp_path_factory.mktemp("lora-encoder-agents")
    export = tmp / "export"
    export.mkdir()
    shutil.copyfile(minilm_onnx, export / "model.onnx")
    shutil.copyfile(minilm_dir() / "tokenizer.json", export / "tokenizer.json")
    port = free_port()
    agent_args = [
        ["--train-data", str(d), "--train-superlink", f"127.0.0.1:{port}"] for d in pair_dirs
    ]
    coordinator_args = ["--superlink-port", str(port), "--train-clients", "3"]
    with decoder_lab(
        export, tmp, MODEL_ID, "512MiB", CAP, 3, coordinator_args, agent_args
    ) as started:
        yield started


@pytest.fixture(scope="module")
def run(lab: GenLab) -> dict[str, Any]:
    with lab.coordinator.client(timeout=120) as api:
        before, embedded = _active(api), _embed(api)
    body = {"rounds": 1, "model": MODEL_ID, "method": "lora", "secure_aggregation": True,
            "dp": True, "lora": {"rank": 4, "first_layer": 4}}  # fmt: skip
    status = finished_run(lab, body, 1200)
    print("encoder LoRA run on the agents:", json.dumps(status, indent=1))  # README numbers (-s)
    return {"status": status, "before": before, "embedded": embedded}


def test_the_run_reports_recall_and_epsilon_per_device(run: dict[str, Any]) -> None:
    status = run["status"]
    assert status["method"] == "lora" and len(status["rounds"]) == 1
    [first] = status["rounds"]
    assert first["clients"] == 3 and first["bytes_uploaded"] > 0, first
    # only the adapters travel: SecAgg+'s masked vector was 2.1 % of the trained segment
    assert 0 < first["bytes_uploaded"] / 3 <= 0.05 * status["trained_shard_bytes"], status
    baseline, final = status["baseline_recall_at_1"], status["final_recall_at_1"]
    # under DP no device releases its held-out recall in clear (protocols.privacy's table): the
    # devices' mean comes out of the SecAgg+ aggregate, before (round 1) and after (the
    # evaluate-only round); bench/encoder_dp.py measures the rise over seeds in the lab
    assert baseline is not None and 0 < baseline <= 1, status
    assert final is not None and 0 < final <= 1, status
    eps = status["epsilon_per_device"]
    assert len(eps) == 3 and all(0 < e <= 8.0 for e in eps), eps


def test_each_agent_trained_on_exactly_the_served_version(lab: GenLab, run: dict[str, Any]) -> None:
    """Each agent's training copy holds the served version's files (manifest and every
    segment, byte for byte) and the deployment's tokenizer, and nothing else."""
    plan = run["before"]["plan_version"]
    served = segment_dir(lab.coordinator.state_dir, MODEL_ID, plan)
    want = {p.name: p for p in served.iterdir()} | {"tokenizer.json": lab.export / "tokenizer.json"}
    assert "manifest.json" in want and len(want) >= 4, sorted(want)  # manifest and segments
    for agent in lab.agents:
        copy = agent.state_dir / "training" / "current"
        assert copy.is_symlink(), f"{agent.name} holds no training copy"
        assert sorted(p.name for p in copy.iterdir()) == sorted(want), agent.name
        for name, path in want.items():
            assert filecmp.cmp(copy / name, path, shallow=False), (agent.name, name)


def test_the_merged_version_is_served_and_embeds(lab: GenLab, run: dict[str, Any]) -> None:
    [rollout] = run["status"]["rollouts"]
    with lab.coordinator.client(timeout=120) as api:
        live = _active(api)
        assert live["plan_version"] == rollout["plan_version"] != run["before"]["plan_version"]
        after = _embed(api)
    np.testing.assert_allclose(np.linalg.norm(after, axis=1), 1.0, atol=1e-4)
    assert np.abs(after - run["embedded"]).max() > 1e-4, "the merged version embeds differently"


def _pair_texts(dirs: list[Path]) -> list[bytes]:
    """Every anchor and positive of every pair (long enough not to match by chance; the
    sentences this test itself sends to ``/v1/embeddings`` left out), as UTF-8."""
    texts = []
    for d in dirs:
        for line in (d / "wordnet.jsonl").read_text(encoding="utf-8").splitlines():
            for text in json.loads(line).values():
                if len(text) >= 20 and text not in TEXTS:
                    texts.append(text.encode())
    return texts


def _holding(places: list[Path], texts: list[bytes]) -> list[str]:
    """Those of ``places`` (a file, or every file under a dir) that hold any of ``texts``."""
    found = []
    for place in places:
        if place.is_dir():
            found += _files_holding(place, texts)
        elif any(t in place.read_bytes() for t in texts):
            found.append(str(place))
    return found


def test_no_pair_left_its_device(lab: GenLab, pair_dirs: list[Path], run: dict[str, Any]) -> None:
    """No anchor or positive is in the coordinator's state dir or log, and none of a device's
    pairs is in another agent's state dir or log."""
    # every third text of each device (some 120-150 of its 360-460: a leak path leaks more than one
    # pair, and the scan of every file for each text is what this test spends its time on)
    own = [_pair_texts([d])[::3] for d in pair_dirs]
    assert all(len(texts) >= 100 for texts in own), [len(texts) for texts in own]
    assert _holding([pair_dirs[0]], own[0]), "the scan finds pairs where they are"
    coordinator = lab.coordinator
    leaks = _holding([coordinator.state_dir, coordinator.log_path], [t for ts in own for t in ts])
    for i, agent in enumerate(lab.agents):  # started in the order of pair_dirs
        others = [t for j, texts in enumerate(own) if j != i for t in texts]
        leaks += _holding([agent.state_dir, agent.log_path], others)
    assert leaks == []
