"""Units of encoder LoRA: the BERT tail, the ranking loss and recall, per-pair DP gradients."""

from __future__ import annotations

import json

import pytest
import torch

from devtools.wordnet import Gloss, definition, pair_record
from edge_agent.training.lora.encoder import (
    build_encoder_tail,
    embed,
    encoder_local_name,
    held_out_ranking,
    ranking_losses,
)

pytest.importorskip("opacus")


def _tiny_tail() -> torch.nn.Module:
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import BertConfig

    config = BertConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        vocab_size=100,
    )  # fmt: skip
    tail = build_encoder_tail("BertModel", config.to_json_string(), 1)
    tail.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in tail.named_parameters():
            p.copy_(torch.ones_like(p) if "LayerNorm.weight" in name else 0.1 * torch.randn_like(p))
    tail.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"]), tail)
    with torch.no_grad():
        for name, p in tail.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    return tail


def test_bert_names_map_to_the_tail_and_earlier_layers_stay_out() -> None:
    assert encoder_local_name("encoder.layer.5.attention.self.query.weight", 4) == (
        "layers.1.attention.self.query.weight"
    )
    assert encoder_local_name("encoder.layer.3.output.dense.weight", 4) is None
    assert encoder_local_name("embeddings.word_embeddings.weight", 0) is None
    assert encoder_local_name("pooler.dense.weight", 0) is None


def test_pads_do_not_change_the_embedding() -> None:
    tail = _tiny_tail().eval()
    hidden = torch.randn(1, 5, 32)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    padded = torch.cat([hidden, 50 * torch.randn(1, 3, 32)], dim=1)
    short = embed(tail, hidden[:, :3], mask[:, :3])
    long = embed(tail, padded, torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)], dim=1))
    torch.testing.assert_close(short, long, atol=1e-5, rtol=1e-5)
    assert torch.allclose(short.norm(dim=1), torch.ones(1))


def test_ranking_loss_and_recall_prefer_the_own_positive() -> None:
    a = torch.nn.functional.normalize(torch.eye(4) + 0.01, dim=1)
    good = ranking_losses(a, a, 20.0)
    bad = ranking_losses(a, a.roll(1, dims=0), 20.0)
    assert good.shape == (4,) and bool((good < bad).all())


def test_held_out_recall_counts_anchors_whose_best_positive_is_their_own() -> None:
    from edge_agent.training.lora.encoder import PairBatch

    tail = _tiny_tail().eval()
    torch.manual_seed(1)
    h = torch.randn(6, 4, 32).numpy()
    mask = torch.ones(6, 4, dtype=torch.int64).numpy()
    same = PairBatch(h, mask, h, mask)
    loss, recall, count = held_out_ranking(tail, same, 20.0)
    assert (recall, count) == (1.0, 6) and loss > 0
    shuffled = PairBatch(h, mask, h[::-1].copy(), mask)
    assert held_out_ranking(tail, shuffled, 20.0)[1] < 1.0
    assert held_out_ranking(tail, None, 20.0)[2] == 0


def test_opacus_sums_the_anchor_and_positive_passes_into_one_gradient_per_pair() -> None:
    from opacus import GradSampleModule

    tail = _tiny_tail().train()
    model = GradSampleModule(tail, loss_reduction="mean")
    torch.manual_seed(2)
    a, p = torch.randn(5, 4, 32), torch.randn(5, 6, 32)
    am, pm = torch.ones(5, 4, dtype=torch.int64), torch.ones(5, 6, dtype=torch.int64)
    pm[:, 4:] = 0
    losses = ranking_losses(embed(model, a, am), embed(model, p, pm), 20.0)
    losses.mean().backward()  # type: ignore[no-untyped-call]
    trained = [q for q in tail.parameters() if q.requires_grad]
    assert trained
    for q in trained:
        per_pair = q.grad_sample  # type: ignore[attr-defined]
        assert per_pair.shape[0] == 5, "one per-sample gradient per pair, not per pass"
        torch.testing.assert_close(per_pair.mean(dim=0), q.grad, atol=1e-6, rtol=1e-4)


def test_wordnet_pairs_leave_the_quoted_examples_out_of_the_positive() -> None:
    g = Gloss("noun.animal", ("dog", "domestic dog"), 'a domesticated canid; "the dog barked"')
    assert definition(g.gloss) == "a domesticated canid"
    record = pair_record(g)
    assert record == {"anchor": "dog, domestic dog", "positive": "a domesticated canid"}
    assert json.loads(json.dumps(record)) == record
    assert definition('"only an example"') == '"only an example"'
