"""Federated LoRA of the served encoder (all-MiniLM-L6-v2) on real WordNet text pairs.

MiniLM is exported (real weights) and split by the planner onto three agents; each device holds
one WordNet domain's ``{"anchor": lemmas, "positive": definition}`` pairs (non-IID). The
devices' own client code trains BERT layers 4-5 with the contrastive (in-batch negatives)
objective under Opacus, with the coordinator's encoder defaults (``LoraTuning``: query and value,
batch 64, 4 local epochs) but noise multiplier 1.3, so that two rounds on 300 pairs a device stay
under epsilon 8 (``bench/encoder_dp.py``: one round at 1.3 spends 4.81); plain FedAvg averages
the rounds. Asserted: held-out recall@1 (each
device's held-out anchors against its held-out positives) rises, epsilon stays at most 8 at
delta 1e-5, only adapter arrays of the planned shapes travel and they are at most 2 % of the
trained segments' weights, and the merged version changes only the adapted segment and
computes the sentence embedding the adapted torch model does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.training.lora.plan import LoraTuning
from devtools.lora_lab import (
    LabRun,
    encoder_setup,
    minilm_model,
    pair_recall,
    plan_config,
    run_rounds,
    split_encoder,
)
from protocols.lora import (
    METRIC_EPSILON,
    METRIC_TRAINED_BYTES,
    RecordDp,
)

pytestmark = pytest.mark.slow

ROUNDS = 2
FIRST_LAYER = 4
PER_DEVICE = 300
NOISE = 1.3
TUNING = LoraTuning()


@pytest.fixture(scope="module")
def lab(minilm_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> LabRun:
    root = tmp_path_factory.mktemp("lora-encoder")
    version = split_encoder(minilm_onnx, root / "v0001")
    setup = encoder_setup(
        minilm_onnx, version, minilm_model(), FIRST_LAYER,
        dp=RecordDp(noise_multiplier=NOISE, max_grad_norm=TUNING.max_grad_norm, delta=1e-5),
        max_tokens=TUNING.encoder_max_tokens, batch_size=TUNING.encoder_batch_size,
        learning_rate=TUNING.encoder_learning_rate, local_epochs=TUNING.encoder_local_epochs,
    )  # fmt: skip
    return run_rounds(setup, root, ROUNDS, PER_DEVICE)


def test_held_out_recall_at_1_rises(lab: LabRun) -> None:
    assert all(n >= 10 for _, n, _ in lab.baseline), "every device holds pairs out"
    before, after = pair_recall(lab.baseline), pair_recall(lab.final)
    assert after > before, (before, after)
    loss_before = sum(loss * n for loss, n, _ in lab.baseline)
    assert sum(loss * n for loss, n, _ in lab.final) < loss_before


def test_under_dp_the_recall_leaves_only_inside_the_secagg_vector(
    lab: LabRun, tmp_path: Path
) -> None:
    """A device's evaluate-only reply under DP and SecAgg+: no recall@1 (nor loss) among its
    metrics, and inside the masked statistics exactly the recall its owner measures."""
    from edge_agent.training.client_app import ShardClient
    from edge_agent.training.local import LocalSettings
    from protocols.lora import (
        EVALUATE_ONLY_KEY,
        METRIC_HELD_OUT_LOSS,
        METRIC_RECALL_AT_1,
        read_stats,
    )
    from protocols.privacy import SECAGG_CONFIG_KEY, reply_fields

    data = lab.data_dirs[0]
    client = ShardClient(LocalSettings(lab.setup.version_dir, data, tmp_path, 1 << 30), 0)
    config = {**plan_config(lab.setup.plan, ROUNDS + 1), SECAGG_CONFIG_KEY: True,
              EVALUATE_ONLY_KEY: True}  # fmt: skip
    arrays, weight, metrics = client.fit(lab.arrays, config)
    assert weight == 1 and set(metrics) <= reply_fields(dp=True)
    assert METRIC_RECALL_AT_1 not in metrics and METRIC_HELD_OUT_LOSS not in metrics
    loss, recall = read_stats(arrays[-1])
    _, _, own = lab.final[0]  # the same adapters, evaluated by the records' owner
    assert recall == pytest.approx(own[METRIC_RECALL_AT_1], abs=1e-6)
    assert loss is not None and loss > 0


def test_epsilon_is_small_and_composes(lab: LabRun) -> None:
    eps = [[m[METRIC_EPSILON] for _, _, m in replies] for replies in lab.rounds]
    assert all(0 < e <= 8.0 for e in eps[-1]), eps
    assert all(b > a for a, b in zip(eps[0], eps[-1], strict=True))


def test_only_small_adapters_travel(lab: LabRun) -> None:
    plan = lab.setup.plan
    rank = plan.lora.rank
    shapes = [s for a in plan.adapters for s in ((rank, a.in_features), (a.out_features, rank))]
    for replies in lab.rounds:
        for arrays, _, metrics in replies:
            assert [tuple(a.shape) for a in arrays] == shapes
            assert all(isinstance(v, int | float | str) for v in metrics.values())
            upload = sum(a.nbytes for a in arrays)
            assert upload <= 0.02 * metrics[METRIC_TRAINED_BYTES], (upload, metrics)


def test_merged_version_embeds_as_the_adapted_model(lab: LabRun) -> None:
    import torch
    from tokenizers import Tokenizer

    from coordinator.training.lora.version import write_lora_version
    from coordinator.training.version import Version
    from partitioner.models.lora import adapters_by_module

    setup, arrays = lab.setup, lab.arrays
    parent = Version.load(setup.version_dir)
    merged = write_lora_version(
        parent, setup.plan, arrays, setup.version_dir.parent / "v0002",
        rounds=ROUNDS, clients_per_round=[3] * ROUNDS, epsilon=1.0,
    )  # fmt: skip
    changed = [
        a.index for a, b in zip(parent.manifest.segments, merged.manifest.segments, strict=True)
        if a.sha256 != b.sha256
    ]  # fmt: skip
    assert changed == setup.plan.trainable
    model = setup.model
    with torch.no_grad():
        modules = dict(model.named_modules())
        for name, (a, b) in adapters_by_module(setup.plan.adapters, arrays).items():
            modules[name].weight += torch.from_numpy(setup.plan.lora.scale * (b @ a))
    tok = Tokenizer.from_file(str(setup.version_dir / "tokenizer.json"))
    tok.no_padding()
    ids = np.array([tok.encode("dog, domestic dog, Canis familiaris").ids], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": 0 * ids}
    with torch.no_grad():
        hidden = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state
    want = torch.nn.functional.normalize(hidden.mean(dim=1), dim=1)[0].numpy()
    got = _chain(merged.segments, feeds)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.abs(got - _chain(parent.segments, feeds)).max() > 1e-4, "the merge changed it"


def _chain(segments: Sequence[Any], feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    env = dict(feeds)
    for seg in segments:
        session = ort.InferenceSession(seg.SerializeToString())
        outs = session.run(None, {i.name: env[i.name] for i in session.get_inputs()})
        env.update({o.name: v for o, v in zip(session.get_outputs(), outs, strict=True)})
    embedding: np.ndarray = env["sentence_embedding"][0]
    return embedding
