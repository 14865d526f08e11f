"""Version numbers per model and the stored kind (issues 41 item 6 and 38 item 4).

Each model's versions are numbered 1, 2, 3, ... on their own, whatever other models deploy in
between; the plan version stays the agents' key, unique across models. A ``deployments.json``
written by the release before (versions without ``version`` or ``kind``, ``active`` and
``previous`` holding plan versions, one counter shared by every model) still loads: it is
migrated on read and written back in today's form at the next change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coordinator.deploy.store import (
    DeploymentStore,
    Placement,
    VersionRecord,
    model_kind,
    segment_dir,
    version_label,
)
from coordinator.errors import StateError
from protocols.decoder import DECODER_FILE
from protocols.manifest import TensorInfo

X = {"name": "x", "dtype": "float32", "shape": ["batch", 4]}
IDS = {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]}
PAST = {"name": "past.0.key", "dtype": "float32", "shape": [1, 1, "past", 8]}
SEGMENT = {
    "index": 0, "device": "a", "host": "127.0.0.1", "control_port": 1, "data_port": 2,
    "sha256": "0" * 64, "param_bytes": 1, "predicted_memory_bytes": 1, "predicted_compute_s": 0.0,
    "measured_memory_bytes": 1, "warmup_s": 0.0, "load_s": 0.0,
}  # fmt: skip


def _old_version(plan: int, state: str, inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """A version as the release before wrote it: no ``version``, no ``kind``."""
    return {
        "model_id": "",
        "plan_version": plan,
        "state": state,
        "created_at": 1.0 + plan,
        "source": "m.onnx",
        "objective": "throughput",
        "inputs": inputs,
        "outputs": [X],
        "segments": [SEGMENT],
        "health_max_abs_diff": 0.0,
    }


def _old_book() -> dict[str, Any]:
    """Two models deployed in turns, one plan-version counter for both (plans 1..5)."""
    enc = [_old_version(1, "retired", [X]), _old_version(3, "previous", [X])]
    enc.append(_old_version(5, "active", [X]))
    dec = [_old_version(2, "previous", [IDS, PAST]), _old_version(4, "active", [IDS, PAST])]
    models = []
    for model_id, versions, active, previous in (("enc", enc, 5, 3), ("dec", dec, 4, 2)):
        for v in versions:
            v["model_id"] = model_id
        models.append(
            {"model_id": model_id, "active": active, "previous": previous, "versions": versions}
        )
    return {"next_plan_version": 6, "models": models}


def test_a_book_of_the_release_before_is_numbered_per_model_on_read(tmp_path: Path) -> None:
    (tmp_path / "deployments.json").write_text(json.dumps(_old_book()))
    store = DeploymentStore(tmp_path)
    enc, dec = store.model("enc"), store.model("dec")
    assert [(v.version, v.plan_version) for v in enc.versions] == [(1, 1), (2, 3), (3, 5)]
    assert [(v.version, v.plan_version) for v in dec.versions] == [(1, 2), (2, 4)]
    assert (enc.active, enc.previous, dec.active, dec.previous) == (3, 2, 2, 1)
    assert {v.kind for v in enc.versions} == {"encoder"}
    assert {v.kind for v in dec.versions} == {"decoder"}
    assert version_label(store.active("enc")) == "enc v3"
    assert store.active("dec").plan_version == 4  # the agents' key is kept as it was
    assert dec.by_plan(4) == store.active("dec")
    # a rollback works on the migrated numbers, and the book is written in today's form
    assert store.rollback("enc").version == 2
    written = json.loads((tmp_path / "deployments.json").read_text())
    assert all("version" in v and "kind" in v for m in written["models"] for v in m["versions"])
    again = DeploymentStore(tmp_path)
    assert again.book() == store.book()
    assert (again.model("enc").active, again.book().next_plan_version) == (2, 6)


def test_a_migrated_model_numbers_its_next_version_after_its_own(tmp_path: Path) -> None:
    (tmp_path / "deployments.json").write_text(json.dumps(_old_book()))
    store = DeploymentStore(tmp_path)
    assert (store.next_version("enc"), store.next_version("dec")) == (4, 3)
    assert store.next_version("new") == 1


def _version(model_id: str, number: int, plan: int) -> VersionRecord:
    placement = Placement.model_validate(SEGMENT)
    return VersionRecord(
        model_id=model_id, version=number, plan_version=plan, kind="encoder", state="active",
        created_at=0.0, source="m.onnx", objective="throughput",
        inputs=[TensorInfo.model_validate(X)], outputs=[TensorInfo.model_validate(X)],
        segments=[placement], health_max_abs_diff=0.0,
    )  # fmt: skip


def test_two_models_deployed_in_turns_each_count_from_one(tmp_path: Path) -> None:
    store = DeploymentStore(tmp_path)
    for model_id in ("a", "b", "a", "b", "a"):
        plan = store.reserve_plan_version()
        store.activate(_version(model_id, store.next_version(model_id), plan), None)
    a, b = store.model("a"), store.model("b")
    assert [(v.version, v.plan_version) for v in a.versions] == [(1, 1), (2, 3), (3, 5)]
    assert [(v.version, v.plan_version) for v in b.versions] == [(1, 2), (2, 4)]
    assert (a.active, a.previous, b.active, b.previous) == (3, 2, 2, 1)
    with pytest.raises(StateError, match="a v3 exists already"):
        store.activate(_version("a", 3, store.reserve_plan_version()), None)


def test_an_unreadable_book_is_a_state_error(tmp_path: Path) -> None:
    (tmp_path / "deployments.json").write_text("{not json")
    with pytest.raises(StateError, match="cannot read"):
        DeploymentStore(tmp_path)


def test_the_kind_is_decided_from_inputs_or_a_decoder_file(tmp_path: Path) -> None:
    x, ids, past = (TensorInfo.model_validate(t) for t in (X, IDS, PAST))
    assert model_kind([x], tmp_path / "m.onnx", None) == "encoder"
    assert model_kind([ids, past], tmp_path / "m.onnx", None) == "decoder"
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    assert model_kind([ids], tmp_path / "m.onnx", tokenizer) == "encoder"
    (tokenizer / DECODER_FILE).write_text("{}")
    assert model_kind([ids], tmp_path / "m.onnx", tokenizer) == "decoder"
    (tmp_path / DECODER_FILE).write_text("{}")
    assert model_kind([ids], tmp_path / "m.onnx", None) == "decoder"


def test_segment_dirs_are_named_by_plan_and_an_earlier_release_s_are_found(
    tmp_path: Path,
) -> None:
    assert segment_dir(tmp_path, "m", 7) == tmp_path / "deployments" / "m" / "plan-7"
    earlier = tmp_path / "deployments" / "m" / "v8"
    earlier.mkdir(parents=True)
    assert segment_dir(tmp_path, "m", 8) == earlier
