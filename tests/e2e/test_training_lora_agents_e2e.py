"""Federated LoRA on the paired agents' own SuperNodes: the text never leaves the devices.

A coordinator started with ``--superlink-port`` and three agents started unpaired with
``--train-data DIR`` (WordNet chat records, one lexicographer domain each) and
``--train-superlink``, paired with their codes; ``tiny-llama`` is served on them. ``POST
/v1/training/runs {"model": "tiny-llama", "method": "lora", "rounds": 1}``: the coordinator
sends each agent the served version (signed copy, hash-checked files), a SuperLink with node
authentication admits the agents' own node keys, and one SecAgg+ round with record-level DP
runs on the agents' SuperNodes. Asserted: the run finishes, each agent trained on exactly the
served version, the merged version is rolled out live and generates, and no record's text is
anywhere in the coordinator's state dir or log.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from generation_lab import GenLab, decoder_lab
from test_training_lora_e2e import _active, finished_run

from coordinator.deploy.store import segment_dir
from coordinator.training.flower import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

MODEL_ID = "tiny-llama"
DOMAINS = (("noun.animal",), ("noun.food",), ("noun.plant",))
PER_DEVICE = 60


@pytest.fixture(scope="module")
def text_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """One WordNet share per device, outside every state dir."""
    from devtools.wordnet import write_shares

    return write_shares(tmp_path_factory.mktemp("text"), DOMAINS, per_device=PER_DEVICE)


@pytest.fixture(scope="module")
def lab(
    tiny_llama_dir: Path, text_dirs: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GenLab]:
    tmp = tmp_path_factory.mktemp("lora-agents")
    port = free_port()
    allow = ["--allow-non-secagg", "--allow-non-dp"]  # one run below has neither
    agent_args = [
        ["--train-data", str(d), "--train-superlink", f"127.0.0.1:{port}", *allow]
        for d in text_dirs
    ]
    coordinator_args = ["--superlink-port", str(port), "--train-clients", "3"]
    with decoder_lab(
        tiny_llama_dir, tmp, MODEL_ID, "512MiB", "12MB", 3, coordinator_args, agent_args
    ) as started:
        yield started


@pytest.fixture(scope="module")
def run(lab: GenLab) -> dict[str, Any]:
    with lab.coordinator.client() as api:
        before = _active(api)
    body = {"rounds": 1, "model": MODEL_ID, "method": "lora", "lora": {"rank": 4}}
    status = finished_run(lab, body, 1200)
    print("LoRA run on the agents:", json.dumps(status, indent=1))  # README numbers (-s)
    return {"status": status, "before": before}


def test_each_agent_trained_on_exactly_the_served_version(lab: GenLab, run: dict[str, Any]) -> None:
    status = run["status"]
    assert status["method"] == "lora" and len(status["rounds"]) == 1
    [first] = status["rounds"]
    assert first["clients"] == 3 and first["bytes_uploaded"] > 0
    assert 0 < first["bytes_uploaded"] / 3 <= 0.02 * status["trained_shard_bytes"], status
    assert status["final_loss"] < status["baseline_loss"], status
    eps = status["epsilon_per_device"]
    assert len(eps) == 3 and all(0 < e <= 8.0 for e in eps), eps
    plan = run["before"]["plan_version"]
    served = segment_dir(lab.coordinator.state_dir, MODEL_ID, plan) / "manifest.json"
    for agent in lab.agents:
        copy = agent.state_dir / "training" / "current"
        assert copy.is_symlink(), f"{agent.name} holds no training copy"
        assert (copy / "manifest.json").read_bytes() == served.read_bytes()
        assert (copy / "tokenizer.json").read_bytes() == (
            lab.export / "tokenizer.json"
        ).read_bytes()


def test_the_merged_version_is_served_and_generates(lab: GenLab, run: dict[str, Any]) -> None:
    [rollout] = run["status"]["rollouts"]
    with lab.coordinator.client(timeout=120) as api:
        live = _active(api)
        assert live["plan_version"] == rollout["plan_version"] != run["before"]["plan_version"]
        body = {"model": MODEL_ID, "prompt": "a small animal", "max_tokens": 8, "temperature": 0}
        done = api.post("/v1/completions", json=body)
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] > 0


def test_a_second_run_trains_the_fine_tuned_version_and_gets_only_what_changed(
    lab: GenLab, run: dict[str, Any]
) -> None:
    """The agents follow the served version: the second run starts from the first one's
    adapters merged, and each agent is sent only the files its copy lacks."""
    with lab.coordinator.client() as api:
        served = _active(api)
    # without DP: a DP round sends its held-out loss only inside the SecAgg+ vector
    body = {"rounds": 1, "model": MODEL_ID, "secure_aggregation": False, "dp": False}
    status = finished_run(lab, body, 900)
    print("second LoRA run on the agents:", json.dumps(status, indent=1))
    assert status["baseline_loss"] == pytest.approx(run["status"]["final_loss"], rel=0.02)
    manifest = segment_dir(lab.coordinator.state_dir, MODEL_ID, served["plan_version"])
    for agent in lab.agents:
        copy = agent.state_dir / "training" / "current"
        assert (copy / "manifest.json").read_bytes() == (manifest / "manifest.json").read_bytes()
        found = re.findall(r"training copy \S+ offered: (\d+) files missing", agent.log())
        first, *_, last = (int(n) for n in found)
        assert first == 5 > last >= 2, found  # the manifest and the changed segments


def _record_texts(dirs: list[Path]) -> list[bytes]:
    """Every message of every record (long enough not to match by chance), as UTF-8."""
    texts = []
    for d in dirs:
        for line in (d / "wordnet.jsonl").read_text(encoding="utf-8").splitlines():
            for message in json.loads(line)["messages"]:
                if len(message["content"]) >= 20:
                    texts.append(message["content"].encode())
    return texts


def _files_holding(root: Path, texts: list[bytes]) -> list[str]:
    return [
        str(path)
        for path in root.rglob("*")
        if path.is_file() and not path.is_symlink()
        for data in [path.read_bytes()]
        if any(t in data for t in texts)
    ]


def test_no_record_reached_the_coordinator(
    lab: GenLab, text_dirs: list[Path], run: dict[str, Any]
) -> None:
    texts = _record_texts(text_dirs)
    assert len(texts) >= 100
    assert _files_holding(text_dirs[0].parent, texts), "the scan finds records where they are"
    assert _files_holding(lab.coordinator.state_dir, texts) == []
    log = lab.coordinator.log_path.read_bytes()
    assert not any(t in log for t in texts)
