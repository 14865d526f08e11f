"""A LoRA run's local-training settings: a request's ``learning_rate``, ``local_epochs`` and
``batch_size`` reach the plan the coordinator builds, a request without them keeps the
coordinator's ``LoraTuning`` (its DP, non-DP and encoder learning rates; decoder and encoder
epochs and batch sizes), out-of-range values are refused, and
``fedshard train --model`` sends them. Fast: the plan is built over a one-segment manifest with
the segment scan (``_boundary``) stubbed, no ONNX model and no torch."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError
from test_training_lora_runs import _decoder_manifest

from coordinator.training.lora import plan as plan_module
from coordinator.training.lora.plan import LoraBase, LoraTuning, build_plan, local_training
from protocols.lora import LoraPlan, Objective
from protocols.training import LoraOptions, TrainingRunRequest

TUNING = LoraTuning()
SHAPES: dict[Objective, dict[str, list[int]]] = {
    "causal-lm": {f"model.layers.{i}.self_attn.q_proj.weight": [4, 4] for i in range(2)},
    "contrastive": {f"encoder.layer.{i}.attention.self.query.weight": [4, 4] for i in range(2)},
}


def _plan(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    objective: Objective,
    options: LoraOptions | None,
    dp: bool,
) -> LoraPlan:
    """build_plan over a one-segment version of a two-layer model of ``objective``."""
    monkeypatch.setattr(plan_module, "_boundary", lambda *_: (0, "hidden"))
    (tmp_path / "manifest.json").write_text(_decoder_manifest().to_json())
    (tmp_path / "tokenizer.json").write_text("{}")
    base = LoraBase(
        model="toy", architecture="Toy", config="{}", num_layers=2, weight_map={},
        shapes=SHAPES[objective], objective=objective,
    )  # fmt: skip
    return build_plan("r", tmp_path, tmp_path / "tokenizer.json", base, options, dp, TUNING)


DECODER = (TUNING.local_epochs, TUNING.batch_size)
ENCODER = (TUNING.encoder_local_epochs, TUNING.encoder_batch_size)


@pytest.mark.parametrize(
    ("objective", "dp", "default_rate", "epochs_batch"),
    [
        ("causal-lm", True, TUNING.learning_rate, DECODER),
        ("causal-lm", False, TUNING.plain_learning_rate, DECODER),
        ("contrastive", True, TUNING.encoder_learning_rate, ENCODER),
        ("contrastive", False, TUNING.encoder_learning_rate, ENCODER),
    ],
)
def test_a_requests_settings_reach_the_plan_and_none_keeps_the_tuning(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    objective: Objective,
    dp: bool,
    default_rate: float,
    epochs_batch: tuple[int, int],
) -> None:
    assert DECODER != ENCODER, "the encoder has its own defaults"
    epochs, batch = epochs_batch
    for options in (None, LoraOptions(rank=4)):
        plan = _plan(tmp_path, monkeypatch, objective, options, dp)
        assert (plan.learning_rate, plan.local_epochs, plan.batch_size) == (
            default_rate, epochs, batch,
        )  # fmt: skip
        assert plan.objective == objective and (plan.dp is not None) == dp
    chosen = LoraOptions(learning_rate=0.123, local_epochs=5, batch_size=7)
    plan = _plan(tmp_path, monkeypatch, objective, chosen, dp)
    assert (plan.learning_rate, plan.local_epochs, plan.batch_size) == (0.123, 5, 7)
    only_rate = local_training(LoraOptions(learning_rate=0.5), objective, TUNING, dp)
    assert (only_rate["learning_rate"], only_rate["local_epochs"]) == (0.5, epochs)
    only_epochs = local_training(LoraOptions(local_epochs=3), objective, TUNING, dp)
    assert (only_epochs["learning_rate"], only_epochs["local_epochs"]) == (default_rate, 3)
    only_batch = local_training(LoraOptions(batch_size=128), objective, TUNING, dp)
    assert (only_batch["batch_size"], only_batch["local_epochs"]) == (128, epochs)


@pytest.mark.parametrize(
    "lora",
    [
        {"learning_rate": 0},
        {"learning_rate": -0.01},
        {"learning_rate": 1.5},
        {"local_epochs": 0},
        {"local_epochs": 21},
        {"local_epochs": 1.5},
        {"batch_size": 0},
        {"batch_size": 1025},
    ],
)
def test_out_of_range_rates_and_epochs_are_refused(lora: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        TrainingRunRequest.model_validate({"rounds": 1, "model": "m", "lora": lora})
    ok = LoraOptions(learning_rate=1.0, local_epochs=20, batch_size=1024)
    assert (ok.learning_rate, ok.local_epochs, ok.batch_size) == (1.0, 20, 1024)


def test_the_api_answers_an_out_of_range_rate_with_a_validation_error(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from coordinator.fleet.registry import DeviceRegistry
    from coordinator.http.app import Services, create_app
    from coordinator.training.manager import TrainingRuns
    from coordinator.trust.ca import CertificateAuthority
    from coordinator.trust.pairing import Pairing

    runs = TrainingRuns(None)  # type: ignore[arg-type]  # the request never starts a run
    pairing = Pairing(tmp_path, CertificateAuthority.open(tmp_path))
    app = create_app(Services("t0ken", DeviceRegistry(), pairing, training=runs))
    body = {"rounds": 1, "model": "m", "lora": {"learning_rate": 2.0}}
    with TestClient(app, headers={"Authorization": "Bearer t0ken"}) as api:
        refused = api.post("/v1/training/runs", json=body)
    assert refused.status_code == 400, refused.text  # the API answers 400 for a malformed body
    assert "learning_rate" in refused.text


def test_fedshard_train_model_sends_rate_epochs_and_batch_only_when_given() -> None:
    from coordinator.training.cli import handler, register
    from coordinator.training.lora.cli import lora_body

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    given = ["train", "--model", "m", "--learning-rate", "0.01", "--local-epochs", "3",
             "--batch-size", "48"]  # fmt: skip
    request = TrainingRunRequest.model_validate(lora_body(parser.parse_args(given)))
    assert request.lora == LoraOptions(learning_rate=0.01, local_epochs=3, batch_size=48)
    short = lora_body(parser.parse_args(["train", "--model", "m", "--lr", "0.2"]))
    assert short["lora"] == {"rank": 8, "learning_rate": 0.2}
    plain = lora_body(parser.parse_args(["train", "--model", "m"]))
    assert plain["lora"] == {"rank": 8}
    for model in (["--model", "m"], []):  # a LoRA run, and a shards run (which has defaults)
        for flag, value in (
            ("--local-epochs", "0"),
            ("--learning-rate", "0"),
            ("--batch-size", "0"),
        ):
            args = parser.parse_args(["train", *model, flag, value])
            assert handler(args) == 2  # refused before anything starts
    shards = parser.parse_args(["train"])
    assert (shards.local_epochs, shards.lr, shards.batch_size) == (None, None, None)  # SHARDS_*
