"""Federated LoRA of the served Qwen2.5-Coder-1.5B int4 through the real API (heavy: ``make
test-qwen``).

Four real agents of 1 GiB on 127.0.0.1, each under a planning cap of 45 % of the model's weights
(as ``make demo`` deploys it: no agent holds half of it), serve the int4 export. The
coordinator's training target lists three WordNet shares (one lexicographer domain each) for
its local SuperNodes. ``POST /v1/training/runs {"model": ID, "method": "lora", "dp": true}`` runs
one SecAgg+ round with record-level DP-SGD on each device, adapting the last two of the 28
layers. Asserted: the coordinator maps the 1.5B model onto its int4 initializers, the run
finishes with the devices' held-out loss at least 10 % lower, epsilon at most 8 per device, the
upload at most 2 % of the trained segments' weights; the merged int4 version is signed, served
live (a new plan version) and generates, and rollback returns to the base and generates what
the base did.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from generation_lab import GenLab, decoder_lab, live_version
from test_generation_qwen_service import AGENT_MEMORY, MODEL_ID, _cap
from test_training_lora_e2e import finished_run

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.timeout(3600)]

DOMAINS = (("noun.animal",), ("noun.food",), ("noun.plant",))
PER_DEVICE = 40
"""As ``bench/federated.py --model qwen2.5-coder-1.5b`` (36 training records a device)."""
FIRST_LAYER = 26
PROMPT = {"model": MODEL_ID, "prompt": "A cat is", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def lab(qwen_int4_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    from devtools.wordnet import write_shares

    tmp = tmp_path_factory.mktemp("lora-qwen")
    dirs = write_shares(tmp / "text", DOMAINS, per_device=PER_DEVICE)
    target = tmp / "target.json"
    target.write_text(
        json.dumps({"model_id": MODEL_ID, "text_client_data": [str(d) for d in dirs]})
    )
    args = ["--training-target", str(target)]
    cap = _cap(qwen_int4_dir)
    with decoder_lab(qwen_int4_dir, tmp, MODEL_ID, AGENT_MEMORY, cap, 4, args) as started:
        yield started


def _complete(lab: GenLab) -> str:
    with lab.coordinator.client(timeout=300) as api:
        done = api.post("/v1/completions", json=PROMPT)
    assert done.status_code == 200, done.text
    return str(done.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def run(lab: GenLab) -> dict[str, Any]:
    before, text = live_version(lab, MODEL_ID), _complete(lab)
    lora = {"rank": 4, "first_layer": FIRST_LAYER}
    body = {"rounds": 1, "model": MODEL_ID, "method": "lora", "dp": True,
            "secure_aggregation": True, "lora": lora}  # fmt: skip
    status = finished_run(lab, body, 3000)
    print("Qwen LoRA run:", json.dumps(status, indent=1))  # the README's numbers (pytest -s)
    return {"status": status, "before": before, "text": text}


def test_the_held_out_loss_falls_under_dp(run: dict[str, Any]) -> None:
    status = run["status"]
    assert status["method"] == "lora" and len(status["rounds"]) == 1
    # 2026-12-06: 4.23 -> 3.37 nats/token (-20.3 %) at epsilon 6.84, the round 140 s
    assert status["final_loss"] <= 0.9 * status["baseline_loss"], status
    eps = status["epsilon_per_device"]
    assert len(eps) == 3 and all(0 < e <= 8.0 for e in eps), eps
    [first] = status["rounds"]
    assert 0 < first["bytes_uploaded"] / first["clients"] <= 0.02 * status["trained_shard_bytes"]


def test_the_merged_int4_version_is_served_and_rolls_back(lab: GenLab, run: dict[str, Any]) -> None:
    [rollout] = run["status"]["rollouts"]
    live = live_version(lab, MODEL_ID)
    assert live["plan_version"] == rollout["plan_version"] != run["before"]["plan_version"]
    version_dir = lab.coordinator.state_dir / "training" / "versions" / MODEL_ID / "v0001"
    assert (version_dir / "manifest.json.sig").is_file()
    assert _complete(lab), "the fine-tuned version generates"
    with lab.coordinator.client(timeout=300) as api:
        back = api.post(f"/v1/deployments/{MODEL_ID}/rollback")
    assert back.status_code == 200, back.text
    assert live_version(lab, MODEL_ID)["plan_version"] == run["before"]["plan_version"]
    assert _complete(lab) == run["text"], "the base answers as before the run"
