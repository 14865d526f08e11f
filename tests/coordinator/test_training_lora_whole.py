"""A LoRA version is re-plannable: the whole merged model it carries computes what its merged
segments compute, splits again like any exported decoder (what a failover does), and the next
run plans from its own LoRA base without loading torch. The plan the coordinator builds from the
export's ``decoder.json`` equals the one built with the torch model in hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from coordinator.training.lora.plan import LORA_BASE_FILE, LoraTuning, build_plan, lora_base
from coordinator.training.lora.version import write_lora_version
from coordinator.training.lora.whole import write_whole_model
from coordinator.training.version import Version
from coordinator.trust.ca import CertificateAuthority
from protocols.training import LoraOptions

pytestmark = pytest.mark.slow


def test_a_lora_version_carries_a_whole_model_that_replans(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from devtools.lora_lab import DEVICES, lora_setup, split_version
    from partitioner.analysis.samples import embedded_samples
    from partitioner.cutting.split import split_model
    from partitioner.cutting.verify import run_chain
    from partitioner.models.decoders import tiny
    from protocols.devices import DeviceList

    parent_dir = split_version(tiny_llama_dir, tmp_path / "v0001")
    model_file = tiny_llama_dir / "model.onnx"
    base = lora_base(model_file, tmp_path / "bases", tmp_path / "cache")
    options = LoraOptions(rank=4, alpha=8.0, first_layer=2)
    plan = build_plan("r", parent_dir, tiny_llama_dir / "tokenizer.json", base, options, True)
    model, _ = tiny.llama()
    lab = lora_setup(tiny_llama_dir, parent_dir, model, 2, dp=plan.dp, settings=plan.lora, run="r")
    assert json.loads(plan.to_json()) == json.loads(
        lab.plan.model_copy(update={"max_tokens": 24, "batch_size": 16, "learning_rate": 0.02,
                                    "local_epochs": 2}).to_json()
    )  # fmt: skip
    plain = build_plan("r", parent_dir, tiny_llama_dir / "tokenizer.json", base, options, False)
    assert plain.dp is None and plain.learning_rate == LoraTuning().plain_learning_rate < 0.02

    rng = np.random.default_rng(0)
    arrays = [rng.normal(0, 0.05, a.shape).astype(np.float32) for a in lab.initial]
    ca = CertificateAuthority.open(tmp_path / "ca")
    out = tmp_path / "v0002"
    parent = Version.load(parent_dir)
    write_lora_version(
        parent, plan, arrays, out, rounds=1, clients_per_round=[3], epsilon=2.0, signer=ca
    )
    whole = write_whole_model(model_file, plan, base, arrays, out)

    samples = embedded_samples(onnx.load(whole))
    assert samples is not None, "the merged model keeps the export's metadata"
    manifest = Version.load(out).manifest
    chain = run_chain([out / s.file for s in manifest.segments], dict(samples))
    alone = run_chain([whole], dict(samples))
    before = run_chain([model_file], dict(samples))
    name = manifest.model.outputs[0].name
    np.testing.assert_allclose(chain[name], alone[name], atol=1e-4)
    assert not np.allclose(before[name], alone[name], atol=1e-4), "the adapters changed it"

    replanned = split_model(whole, DeviceList.model_validate(DEVICES), tmp_path / "replanned")
    assert replanned.manifest.sessions is not None, "split again as a decoder"

    again = lora_base(whole, tmp_path / "empty", tmp_path / "cache")
    assert again == base and (out / LORA_BASE_FILE).is_file()
    assert not (tmp_path / "empty").exists(), "planned from the version's own LoRA base"
