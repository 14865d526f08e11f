"""Federated LoRA of a served decoder on real text: three devices, record-level DP, a new version.

The tiny Llama is exported and split by the planner (its layers and embedding on one segment,
norm and head on the other); each device holds one WordNet domain (non-IID). The devices' own
client code (the agents' Flower ``NumPyClient``) trains layers 2.. with Opacus; the rounds are
averaged here with plain FedAvg (the Flower wiring is tested elsewhere). Asserted: the held-out
loss of the devices' own domains drops by at least 10 %, epsilon per record stays at most 8 at
delta 1e-5, the upload is at most 2 % of the trained segments' weights, nothing but adapter
arrays of the planned shapes and numeric metrics leaves a device, and the merged version
changes only the segment with adapted layers, is signed, and computes what the adapted model
does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from devtools.lora_lab import LabRun, lora_setup, run_rounds, split_version, token_mean
from protocols.lora import METRIC_EPSILON, METRIC_TRAINED_BYTES, RecordDp

pytestmark = pytest.mark.slow

ROUNDS = 2
FIRST_LAYER = 2
PER_DEVICE = 100


@pytest.fixture(scope="module")
def lab(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LabRun:
    from partitioner.models.decoders import tiny

    root = tmp_path_factory.mktemp("lora")
    version = split_version(tiny_llama_dir, root / "v0001")
    model, _ = tiny.llama()
    setup = lora_setup(
        tiny_llama_dir,
        version,
        model,
        FIRST_LAYER,
        dp=RecordDp(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5),
        max_tokens=24,
        batch_size=16,
        learning_rate=0.02,
        local_epochs=2,
    )
    return run_rounds(setup, root, ROUNDS, PER_DEVICE)


def test_held_out_loss_drops_by_ten_percent(lab: LabRun) -> None:
    before, after = token_mean(lab.baseline), token_mean(lab.final)
    assert all(n > 0 for _, n, _ in lab.baseline), "every device holds records out"
    assert after <= 0.9 * before, (before, after)


def test_record_level_epsilon_is_reported_and_small(lab: LabRun) -> None:
    eps = [[m[METRIC_EPSILON] for _, _, m in replies] for replies in lab.rounds]
    assert all(0 < e <= 8.0 for e in eps[-1]), eps
    assert all(later > earlier for earlier, later in zip(eps[0], eps[-1], strict=True)), (
        "the accountant composes the rounds of the run"
    )


def test_only_adapters_travel_and_they_are_small(lab: LabRun) -> None:
    plan = lab.setup.plan
    rank = plan.lora.rank
    shapes = [s for a in plan.adapters for s in ((rank, a.in_features), (a.out_features, rank))]
    records = [
        line for d in lab.data_dirs for line in (d / "wordnet.jsonl").read_text().splitlines()
    ]
    for replies in lab.rounds:
        for arrays, _, metrics in replies:
            assert [tuple(a.shape) for a in arrays] == shapes
            assert all(a.dtype == np.float32 for a in arrays)
            assert all(isinstance(v, int | float | str) for v in metrics.values())
            text = [v for v in metrics.values() if isinstance(v, str)]
            assert all(not any(t and t in r for r in records) for t in text if len(t) > 3)
            upload = sum(a.nbytes for a in arrays)
            assert upload <= 0.02 * metrics[METRIC_TRAINED_BYTES], (upload, metrics)


def test_merged_version_changes_one_segment_and_equals_the_adapted_model(
    lab: LabRun,
) -> None:
    import onnxruntime as ort
    import torch

    from coordinator.training.errors import RolloutError
    from coordinator.training.lora.version import write_lora_version
    from coordinator.training.rollout import verify_signature
    from coordinator.training.version import SIGNATURE_FILE, Version
    from coordinator.trust.ca import CertificateAuthority
    from partitioner.models.decoders.export import step_feeds
    from partitioner.models.lora import adapters_by_module

    setup, arrays, root = lab.setup, lab.arrays, lab.setup.version_dir.parent
    parent = Version.load(setup.version_dir)
    ca = CertificateAuthority.open(root / "ca")
    merged = write_lora_version(
        parent, setup.plan, arrays, root / "v0002",
        rounds=ROUNDS, clients_per_round=[3] * ROUNDS, epsilon=1.0, signer=ca,
    )  # fmt: skip
    changed = [
        a.index for a, b in zip(parent.manifest.segments, merged.manifest.segments, strict=True)
        if a.sha256 != b.sha256
    ]  # fmt: skip
    layer_segment = setup.plan.trainable[0]
    assert changed == [layer_segment]
    verify_signature(merged.path, ca.cert_pem)
    (merged.path / SIGNATURE_FILE).write_bytes(
        b"\x00" + (merged.path / SIGNATURE_FILE).read_bytes()
    )
    with pytest.raises(RolloutError, match="signature"):
        verify_signature(merged.path, ca.cert_pem)
    # the adapted torch model, merged by hand
    model = setup.model
    scale = setup.plan.lora.scale
    with torch.no_grad():
        modules = dict(model.named_modules())
        for name, (a, b) in adapters_by_module(setup.plan.adapters, arrays).items():
            modules[name].weight += torch.from_numpy(scale * (b @ a))
    ids = [101, 2054, 2515, 3899, 2812, 1029, 102]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].numpy()
    env: dict[str, np.ndarray] = {}
    past = [np.zeros((1, 2, 0, 16), np.float32) for _ in range(8)]
    feeds_list = step_feeds(ids, past)
    names = ["input_ids", "attention_mask", "position_ids"] + [
        f"past.{i}.{k}" for i in range(4) for k in ("key", "value")
    ]
    env.update(dict(zip(names, feeds_list, strict=True)))
    for seg in merged.segments:
        session = ort.InferenceSession(seg.SerializeToString())
        outs = session.run(None, {i.name: env[i.name] for i in session.get_inputs()})
        env.update({o.name: v for o, v in zip(session.get_outputs(), outs, strict=True)})
    top_ids = env["top_ids"][0]
    np.testing.assert_allclose(env["top_logits"][0], logits[top_ids], atol=1e-4)
