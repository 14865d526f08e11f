"""Federated LoRA of a served decoder through the real API: real Flower, real agents serving it.

A coordinator and three paired agents on 127.0.0.1 serve ``tiny-llama`` (three segments). The
coordinator's training target lists three WordNet shares (one lexicographer domain each, non-IID)
for its local SuperNodes; each SuperNode has its own node key, registered with the run's
SuperLink (node authentication on). ``POST /v1/training/runs {"model": "tiny-llama", "method":
"lora"}`` runs two rounds under SecAgg+ with record-level DP-SGD on each device; asserted: the
run finishes, the devices' held-out loss drops by at least 10 %, each device's epsilon is at most
8 (delta 1e-5), the upload is at most 2 % of the trained segments' weights, the new signed
version is served (a new plan version, generation works, it is re-plannable from the whole model
it carries) and rollback returns to the base.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from generation_lab import GenLab, decoder_lab

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

MODEL_ID = "tiny-llama"
DOMAINS = (("noun.animal",), ("noun.food",), ("noun.plant",))
PER_DEVICE = 100
ROUNDS = 2


@pytest.fixture(scope="module")
def lab(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    from devtools.wordnet import write_shares

    tmp = tmp_path_factory.mktemp("lora-e2e")
    dirs = write_shares(tmp / "text", DOMAINS, per_device=PER_DEVICE)
    target = tmp / "target.json"
    spec = {"model_id": MODEL_ID, "text_client_data": [str(d) for d in dirs]}
    target.write_text(json.dumps(spec))
    args = ["--training-target", str(target)]
    with decoder_lab(tiny_llama_dir, tmp, MODEL_ID, "512MiB", "12MB", 3, args) as started:
        yield started


def _active(api: httpx.Client) -> dict[str, Any]:
    [record] = [m for m in api.get("/v1/deployments").json() if m["model_id"] == MODEL_ID]
    [live] = [v for v in record["versions"] if v["state"] == "active"]
    return dict(live)


def _wait(api: httpx.Client, run_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = api.get(f"/v1/training/runs/{run_id}").json()
        if status["status"] in ("finished", "failed"):
            return dict(status)
        time.sleep(2)
    raise AssertionError(f"run {run_id} did not end within {timeout_s} s")


def finished_run(lab: GenLab, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``POST /v1/training/runs`` with ``body``; its status once it finished (asserted)."""
    with lab.coordinator.client(timeout=60) as api:
        started = api.post("/v1/training/runs", json=body)
        assert started.status_code == 200, started.text
        status = _wait(api, started.json()["run_id"], timeout_s)
    assert status["status"] == "finished", (status, lab.coordinator.log()[-4000:])
    return status


@pytest.fixture(scope="module")
def run(lab: GenLab) -> dict[str, Any]:
    with lab.coordinator.client(timeout=60) as api:
        before = _active(api)
        body = {"rounds": ROUNDS, "model": MODEL_ID, "method": "lora", "lora": {"rank": 4}}
        started = api.post("/v1/training/runs", json=body)
        assert started.status_code == 200, started.text
        status = _wait(api, started.json()["run_id"], 1200)
    assert status["status"] == "finished", (status, lab.coordinator.log()[-4000:])
    print("LoRA run:", json.dumps(status, indent=1))  # the README's numbers (pytest -s)
    return {"status": status, "before": before}


def test_unknown_or_malformed_requests_are_refused(lab: GenLab) -> None:
    with lab.coordinator.client() as api:
        missing = api.post("/v1/training/runs", json={"rounds": 1, "model": "nope"})
        assert missing.status_code == 404, missing.text
        bad = api.post("/v1/training/runs", json={"rounds": 1, "method": "lora"})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["code"] if "error" in bad.json() else bad.json()


def test_held_out_loss_drops_and_epsilon_is_small(run: dict[str, Any]) -> None:
    status = run["status"]
    assert status["method"] == "lora" and status["model_id"] == MODEL_ID
    assert len(status["rounds"]) == ROUNDS
    assert status["final_loss"] <= 0.9 * status["baseline_loss"], status
    eps = status["epsilon_per_device"]
    assert len(eps) == 3 and all(0 < e <= 8.0 for e in eps), eps


def test_upload_is_at_most_two_percent_of_the_trained_weights(run: dict[str, Any]) -> None:
    status = run["status"]
    for r in status["rounds"]:
        per_client = r["bytes_uploaded"] / r["clients"]
        assert 0 < per_client <= 0.02 * status["trained_shard_bytes"], (r, status)


def test_the_new_version_is_served_and_generates(lab: GenLab, run: dict[str, Any]) -> None:
    [rollout] = run["status"]["rollouts"]
    with lab.coordinator.client(timeout=120) as api:
        live = _active(api)
        assert live["plan_version"] == rollout["plan_version"] != run["before"]["plan_version"]
        assert live["source"].endswith("model.onnx"), "re-plannable from its whole model"
        body = {"model": MODEL_ID, "prompt": "a small animal", "max_tokens": 8, "temperature": 0}
        done = api.post("/v1/completions", json=body)
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] > 0
    version_dir = lab.coordinator.state_dir / "training" / "versions" / MODEL_ID / "v0001"
    assert (version_dir / "manifest.json.sig").is_file()
    lineage = json.loads((version_dir / "lineage.json").read_text())
    assert lineage["rounds"] == ROUNDS and 0 < lineage["epsilon"] <= 8.0


def test_each_local_device_keeps_its_prefix_cache_after_the_run(
    lab: GenLab, run: dict[str, Any]
) -> None:
    """The frozen prefix's activations of each device's records outlive the run (in the
    coordinator's state dir for its local SuperNodes), so a later run on the same segments
    and records reads them instead of running the prefix again."""
    from coordinator.training.target import LOCAL_CACHE

    root = lab.coordinator.state_dir / "training" / LOCAL_CACHE
    cached = {d.name: sorted(d.glob("lora-prefix-*.npy")) for d in root.iterdir()}
    assert sorted(cached) == ["agent-0", "agent-1", "agent-2"], cached
    assert all(len(files) == 2 for files in cached.values()), cached  # train and held out


def test_rollback_returns_to_the_base(lab: GenLab, run: dict[str, Any]) -> None:
    with lab.coordinator.client(timeout=120) as api:
        back = api.post(f"/v1/deployments/{MODEL_ID}/rollback")
        assert back.status_code == 200, back.text
        assert _active(api)["plan_version"] == run["before"]["plan_version"]
        again = api.post(f"/v1/deployments/{MODEL_ID}/rollback")  # and forward again
        assert again.status_code == 200, again.text
        assert _active(api)["plan_version"] == run["status"]["rollouts"][0]["plan_version"]


def test_a_second_run_fine_tunes_the_fine_tuned_version(lab: GenLab, run: dict[str, Any]) -> None:
    """Planned from the version the first run wrote (its own whole model and LoRA base), with
    the SuperNodes reading the segments served now."""
    with lab.coordinator.client(timeout=60) as api:
        first = _active(api)
        # without DP: a DP round sends its held-out loss only inside the SecAgg+ vector
        body = {"rounds": 1, "model": MODEL_ID, "secure_aggregation": False, "dp": False}
        started = api.post("/v1/training/runs", json=body)
        assert started.status_code == 200, started.text
        status = _wait(api, started.json()["run_id"], 900)
        assert status["status"] == "finished", (status, lab.coordinator.log()[-4000:])
        print("second LoRA run:", json.dumps(status, indent=1))
        assert status["baseline_loss"] == pytest.approx(run["status"]["final_loss"], rel=0.02)
        [rollout] = status["rollouts"]
        assert rollout["directory"] == "v0002"
        assert rollout["version"] == run["status"]["rollouts"][0]["version"] + 1
        assert _active(api)["plan_version"] == rollout["plan_version"]
        back = api.post(f"/v1/deployments/{MODEL_ID}/rollback")
        assert back.status_code == 200, back.text
        assert _active(api)["plan_version"] == first["plan_version"]
