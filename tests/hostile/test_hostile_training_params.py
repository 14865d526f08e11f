"""Hostile API input, second round: training parameters are checked against the model at once.

``lora.first_layer`` of 10^9 was accepted with 200 and the run failed later. The admission check
of ``POST /v1/training/runs`` now checks a LoRA request's options against the served model's
layers (its ``decoder.json``) and answers 400 with the valid range before anything starts.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.app import Services, create_app
from coordinator.training.errors import LoraTargetError
from coordinator.training.lora.plan import admit_options
from coordinator.training.lora.runner import LoraRunner, LoraTarget
from coordinator.training.manager import RunReporter, TrainingRuns
from coordinator.training.target import _admission
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing
from protocols.decoder import DECODER_FILE, DecoderInfo, StatePair
from protocols.training import LoraOptions, TrainingRunRequest

TOKEN = "tok"
LAYERS = 18


def _decoder(tmp: Path) -> Path:
    """A model file with a ``decoder.json`` of :data:`LAYERS` layers beside it (never loaded)."""
    model_dir = tmp / "gemma"
    model_dir.mkdir()
    info = DecoderInfo(
        model="gemma3-270m",
        architecture="Gemma3ForCausalLM",
        num_layers=LAYERS,
        hidden_size=640,
        num_kv_heads=1,
        head_dim=256,
        vocab_size=262144,
        top_k=8,
        max_context=32768,
        state=[StatePair(past="past.0.key", present="present.0.key")],
    )
    (model_dir / DECODER_FILE).write_bytes(info.to_json().encode())
    return model_dir / "model.onnx"


def test_options_outside_the_model_are_refused_with_the_valid_range(tmp_path: Path) -> None:
    model = _decoder(tmp_path)
    admit_options(None, model)
    admit_options(LoraOptions(first_layer=LAYERS - 1), model)
    with pytest.raises(LoraTargetError, match=f"0 to {LAYERS - 1}"):
        admit_options(LoraOptions(first_layer=10**9), model)
    with pytest.raises(LoraTargetError, match="unknown target modules"):
        admit_options(LoraOptions(target_modules=["lm_head"]), model)


class _Never:
    def run(
        self, run_id: str, request: TrainingRunRequest, report: RunReporter, stop: threading.Event
    ) -> None:
        raise AssertionError("a refused request must not start")


def test_the_api_answers_400_before_a_run_with_a_first_layer_past_the_model(
    tmp_path: Path,
) -> None:
    model = _decoder(tmp_path)

    def resolve(model_id: str) -> LoraTarget:
        return LoraTarget(
            model_id=model_id,
            version_dir=tmp_path / "version",
            model_file=model,
            tokenizer_file=tmp_path / "tokenizer.json",
            versions_root=tmp_path / "versions",
            population=3,
        )

    lora = LoraRunner(
        tmp_path / "training",
        CertificateAuthority.open(tmp_path),
        resolve,
        federation=None,  # type: ignore[arg-type]  # admission never reaches it
        publish=None,
        model_cache=tmp_path / "cache",
    )
    runs = TrainingRuns(_Never(), ready=_admission(lora, False))
    pairing = Pairing(tmp_path, CertificateAuthority.open(tmp_path))
    app = create_app(Services(TOKEN, DeviceRegistry(), pairing, training=runs))
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        body = {"rounds": 1, "model": "gemma3-270m", "lora": {"first_layer": 10**9}}
        refused = api.post("/v1/training/runs", json=body)
        assert refused.status_code == 400, refused.text
        assert f"0 to {LAYERS - 1}" in refused.text
        assert api.get("/v1/training/runs").json() == {"runs": []}
