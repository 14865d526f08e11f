"""Contrastive LoRA of the served MiniLM through the real API: real Flower, real agents.

A coordinator and three paired agents on 127.0.0.1 serve ``fedshard export minilm --pooled``
(planning caps of 70 MB per agent). Three local SuperNodes (SecAgg+'s least) hold WordNet
pairs of one domain each (``{"anchor", "positive"}``). ``POST /v1/training/runs {"model": ID,
"method": "lora", "lora": {..., "batch_size": 16, "local_epochs": 2}}`` runs one round under SecAgg+
with record-level DP (the request's batch size and epochs, as 80 pairs a device would spend
an epsilon above 8 at the encoder's default 64 and 4); asserted: the run finishes
and reports held-out recall@1 before and after, read from the SecAgg+ aggregate (no device
sends its own in clear: tests/coordinator/test_training_lora_encoder.py), the merged version
is served (new plan version), ``/v1/embeddings`` answers with changed unit-norm embeddings, and
rollback returns the old ones.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from generation_lab import GenLab, decoder_lab
from test_training_lora_e2e import _wait

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL_ID = "minilm-served"
CAP = "70MB"
"""Per agent: MiniLM's 90 MB (its 46 MB word embeddings in one) take two or three segments."""
TEXTS = ["dog, domestic dog, Canis familiaris", "an edible fruit", "a woody plant"]


@pytest.fixture(scope="module")
def lab(minilm_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    from devtools.wordnet import write_shares
    from partitioner.models.packaged import minilm_dir

    tmp = tmp_path_factory.mktemp("lora-encoder-e2e")
    export = tmp / "export"
    export.mkdir()
    shutil.copyfile(minilm_onnx, export / "model.onnx")
    shutil.copyfile(minilm_dir() / "tokenizer.json", export / "tokenizer.json")
    domains = (("noun.animal",), ("noun.food",), ("noun.plant",))  # SecAgg+ needs three
    dirs = write_shares(tmp / "pairs", domains, 80, pairs=True)
    target = tmp / "target.json"
    target.write_text(
        json.dumps({"model_id": MODEL_ID, "text_client_data": [str(d) for d in dirs]})
    )
    args = ["--training-target", str(target)]
    with decoder_lab(export, tmp, MODEL_ID, "512MiB", CAP, 3, args) as started:
        yield started


def _active(api: httpx.Client) -> dict[str, Any]:
    [record] = [m for m in api.get("/v1/deployments").json() if m["model_id"] == MODEL_ID]
    [live] = [v for v in record["versions"] if v["state"] == "active"]
    return dict(live)


def _embed(api: httpx.Client) -> np.ndarray:
    done = api.post("/v1/embeddings", json={"model": MODEL_ID, "input": TEXTS})
    assert done.status_code == 200, done.text
    return np.array([d["embedding"] for d in done.json()["data"]])


def test_a_lora_run_of_the_served_encoder_is_rolled_out(lab: GenLab) -> None:
    with lab.coordinator.client(timeout=120) as api:
        before, base = _embed(api), _active(api)
        lora = {"rank": 4, "first_layer": 4, "batch_size": 16, "local_epochs": 2}
        body = {"rounds": 1, "model": MODEL_ID, "method": "lora", "secure_aggregation": True,
                "lora": lora}  # fmt: skip
        started = api.post("/v1/training/runs", json=body)
        assert started.status_code == 200, started.text
        status = _wait(api, started.json()["run_id"], 800)
        assert status["status"] == "finished", (status, lab.coordinator.log()[-4000:])
        print("encoder LoRA run:", json.dumps(status, indent=1))  # the README's numbers
        # under DP no device releases its held-out recall in clear (protocols.privacy's table):
        # both figures are the devices' mean, read from the SecAgg+ aggregate (before: round
        # 1's statistics; after: the evaluate-only round's)
        baseline, final = status["baseline_recall_at_1"], status["final_recall_at_1"]
        assert baseline is not None and 0 < baseline <= 1, status
        assert final is not None and 0 < final <= 1, status
        assert status["baseline_loss"] is not None and status["final_loss"] is not None, status
        [only] = status["rounds"]  # the evaluate-only round is no training round
        assert only["clients"] == 3, only
        assert len(status["epsilon_per_device"]) == 3 and all(
            0 < e <= 8 for e in status["epsilon_per_device"]
        )
        [rollout] = status["rollouts"]
        live = _active(api)
        assert live["plan_version"] == rollout["plan_version"] != base["plan_version"]
        after = _embed(api)
        np.testing.assert_allclose(np.linalg.norm(after, axis=1), 1.0, atol=1e-4)
        assert np.abs(after - before).max() > 1e-4, "the merged version embeds differently"
        back = api.post(f"/v1/deployments/{MODEL_ID}/rollback")
        assert back.status_code == 200, back.text
        assert _active(api)["plan_version"] == base["plan_version"]
        np.testing.assert_allclose(_embed(api), before, atol=1e-5)
