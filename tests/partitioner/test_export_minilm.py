"""``fedshard export minilm``: real weights, dynamic batch and sequence axes, embedded samples."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest

from partitioner.analysis.modelio import load_model
from partitioner.analysis.samples import embedded_samples
from partitioner.cutting.verify import run_model

pytestmark = pytest.mark.slow


def test_export_matches_pytorch_and_declares_dynamic_axes(minilm_export: Any) -> None:
    assert minilm_export.max_abs_diff < 1e-4
    assert minilm_export.outputs == ("last_hidden_state", "sentence_embedding")
    assert minilm_export.param_bytes > 80_000_000  # 22.7 M float32 parameters
    model = onnx.load(str(minilm_export.path), load_external_data=False)
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    for graph_input in model.graph.input:
        dims = graph_input.type.tensor_type.shape.dim
        assert len(dims) == 2 and all(d.dim_param and not d.dim_value for d in dims)


def test_embedded_samples_are_real_padded_token_ids(minilm_export: Any) -> None:
    samples = embedded_samples(load_model(minilm_export.path))
    assert samples is not None
    ids, mask = samples["input_ids"], samples["attention_mask"]
    assert ids.dtype == np.int64 and ids.shape == mask.shape and ids.shape[0] == 3
    assert (ids[:, 0] == 101).all()  # [CLS]
    assert mask.min() == 0 and mask.max() == 1  # the short sentence is padded


@pytest.mark.parametrize(("batch", "tokens"), [(1, 5), (4, 40)])
def test_other_batch_and_sequence_sizes_run(minilm_export: Any, batch: int, tokens: int) -> None:
    rng = np.random.default_rng(batch)
    ids = rng.integers(1000, 30000, size=(batch, tokens)).astype(np.int64)
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "token_type_ids": np.zeros_like(ids),
    }
    out = run_model(minilm_export.path, feeds)
    assert out["last_hidden_state"].shape == (batch, tokens, 384)
    norms = np.linalg.norm(out["sentence_embedding"], axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)
