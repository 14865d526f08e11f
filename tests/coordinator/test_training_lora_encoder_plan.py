"""Which served models a LoRA run can fine-tune, and the contrastive plan of the served MiniLM.

Unit: an ONNX file is a decoder export (``decoder.json`` beside it), an encoder export (the
``fedshard.encoder`` metadata of ``fedshard export minilm``) or refused with an error that says
how to re-export it; encoder plans take BERT's target modules and refuse a decoder's. Slow: the
plan the coordinator builds from the real MiniLM export equals the one the lab builds with the
torch model in hand, and a split MiniLM version is health-checked on one sentence's feeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from coordinator.training.errors import LoraTargetError as CoordinatorError
from coordinator.training.lora.plan import lora_objective, lora_settings
from protocols.lora import (
    DEFAULT_TARGETS,
    ENCODER_DEFAULT_TARGETS,
    ENCODER_METADATA_KEY,
    ENCODER_TARGETS,
)
from protocols.training import LoraOptions


def _onnx(path: Path, metadata: dict[str, str]) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph)
    for key, value in metadata.items():
        prop = model.metadata_props.add()
        prop.key, prop.value = key, value
    onnx.save(model, path)
    return path


def test_an_encoder_export_is_told_by_its_metadata(tmp_path: Path) -> None:
    path = _onnx(tmp_path / "minilm.onnx", {ENCODER_METADATA_KEY: "all-minilm-l6-v2"})
    assert lora_objective(path) == ("contrastive", "all-minilm-l6-v2")


def test_an_old_export_without_metadata_is_refused_clearly(tmp_path: Path) -> None:
    path = _onnx(tmp_path / "old.onnx", {})
    with pytest.raises(CoordinatorError) as caught:
        lora_objective(path)
    assert "fedshard export minilm --pooled" in str(caught.value)
    assert ENCODER_METADATA_KEY in str(caught.value)


def test_an_unknown_encoder_or_a_broken_decoder_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CoordinatorError, match="unknown encoder"):
        lora_objective(_onnx(tmp_path / "e.onnx", {ENCODER_METADATA_KEY: "some-bert"}))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "decoder.json").write_text(json.dumps({"model": 3}))
    with pytest.raises(CoordinatorError, match="not a fedshard decoder export"):
        lora_objective(_onnx(tmp_path / "d" / "model.onnx", {}))


def test_encoder_plans_take_bert_modules() -> None:
    assert lora_settings(None, "contrastive").target_modules == list(ENCODER_DEFAULT_TARGETS)
    assert set(ENCODER_DEFAULT_TARGETS) < set(ENCODER_TARGETS)
    every = LoraOptions(target_modules=list(ENCODER_TARGETS))
    assert lora_settings(every, "contrastive").target_modules == list(ENCODER_TARGETS)
    assert lora_settings(None).target_modules == list(DEFAULT_TARGETS)
    assert lora_settings(LoraOptions(target_modules=["query"]), "contrastive").rank == 8
    with pytest.raises(CoordinatorError, match="unknown target modules"):
        lora_settings(LoraOptions(target_modules=["q_proj"]), "contrastive")


@pytest.mark.slow
def test_the_coordinators_encoder_plan_is_the_labs(minilm_onnx: Path, tmp_path: Path) -> None:
    from coordinator.training.lora.plan import build_plan, lora_base
    from coordinator.training.lora.target import health_samples
    from devtools.lora_lab import encoder_setup, minilm_model, split_encoder

    version = split_encoder(minilm_onnx, tmp_path / "v0001")
    base = lora_base(minilm_onnx, tmp_path / "bases", tmp_path / "cache")
    assert base.objective == "contrastive" and base.architecture == "BertModel"
    options = LoraOptions(rank=4, alpha=8.0, first_layer=4)
    plan = build_plan("r", version, version / "tokenizer.json", base, options, True)
    lab = encoder_setup(minilm_onnx, version, minilm_model(), 4, dp=plan.dp, run="r")
    want = lab.plan.model_copy(
        update={"max_tokens": 32, "batch_size": 64, "learning_rate": 0.01, "local_epochs": 4}
    )
    assert json.loads(plan.to_json()) == json.loads(want.to_json())
    assert lora_base(minilm_onnx, tmp_path / "bases", tmp_path / "cache") == base, "cached"
    samples = health_samples(version)
    assert sorted(samples) == ["attention_mask", "input_ids", "token_type_ids"]
    assert samples["input_ids"].shape == samples["attention_mask"].shape == (1, 5)
