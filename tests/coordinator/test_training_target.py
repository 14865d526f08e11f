"""The training target is configuration: a file names what runs fine-tune; without one, 409."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from coordinator.errors import UnknownModelError
from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.app import Services, create_app
from coordinator.training.errors import TrainingError
from coordinator.training.target import configured_target, coordinator_runs, load_target
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing
from protocols.training import TrainingTargetSpec

AUTH = {"Authorization": "Bearer tok"}


class NothingServed:
    """A deployment store that serves nothing (and a deployer that is never asked)."""

    def active(self, model_id: str) -> Any:
        raise UnknownModelError(f"no model {model_id!r} is deployed")

    def segment_dir(self, model_id: str, plan_version: int) -> Path:
        raise AssertionError("nothing is served")


def _spec(tmp_path: Path, **fields: Any) -> Path:
    spec = TrainingTargetSpec(
        model_id="digits-cnn",
        version_dir="versions/v0001",
        test_file="test.npz",
        client_data=["clients/0", "clients/1"],
        budgets=[50_000, 1 << 30],
        **fields,
    )
    path = tmp_path / "task" / "target.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(spec.model_dump_json())
    return path


def test_without_a_target_a_run_is_a_409_that_says_what_to_configure(tmp_path: Path) -> None:
    ca = CertificateAuthority.open(tmp_path)
    runs = coordinator_runs(tmp_path, ca, NothingServed(), NothingServed(), None)  # type: ignore[arg-type]
    app = create_app(Services("tok", DeviceRegistry(), Pairing(tmp_path, ca), training=runs))
    with TestClient(app, headers=AUTH) as api:
        refused = api.post("/v1/training/runs", json={"rounds": 1})
        assert refused.status_code == 409
        assert "--training-target" in refused.json()["detail"]
        assert api.get("/v1/training/runs").json() == {"runs": []}


def test_a_target_file_names_the_version_data_and_budgets(tmp_path: Path) -> None:
    path = _spec(tmp_path)
    nothing = NothingServed()
    target = configured_target(path, tmp_path / "state", nothing, nothing)  # type: ignore[arg-type]
    root = path.parent
    assert target.version_dir == root / "versions" / "v0001"
    assert target.test_file == root / "test.npz"
    assert target.data_dirs == (root / "clients" / "0", root / "clients" / "1")
    assert target.budgets == (50_000, 1 << 30) and target.population == 2
    assert target.model_id is None  # not served: new versions are only written
    assert target.versions_root == root / "versions"


@pytest.mark.parametrize(
    "text",
    [
        "{",
        '{"model_id": "m", "version_dir": "v", "test_file": "t", "budgets": [1]}',
        '{"model_id": "m", "version_dir": "v", "test_file": "t", "surprise": 1}',
        '{"format": "fedshard.training-target/9", "model_id": "m", "version_dir": "v", '
        '"test_file": "t"}',
    ],
    ids=["truncated", "budget-without-client", "unknown-field", "other-format"],
)
def test_a_bad_target_file_is_a_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "target.json"
    path.write_text(text)
    with pytest.raises(TrainingError, match="is not a training target"):
        load_target(path)
    with pytest.raises(TrainingError, match="cannot read"):
        load_target(tmp_path / "missing.json")
