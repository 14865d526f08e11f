"""The scale benches' Llama 3 files (``bench/_gguf_llama3.py``): Q4_K_M's type choice, a
header-only file the unit table reads as the full model, and random weights of the wanted spread."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _gguf_llama3 import (
    LLAMA3_70B,
    Llama3Shape,
    q4_k_m_tensors,
    use_more_bits,
    write_header_only,
    write_random,
)

from partitioner.models.gguf.header import read_header
from partitioner.models.gguf.reader import GgufFile
from partitioner.models.gguf.units import unit_table

T = GGMLQuantizationType
SMALL = Llama3Shape("small", layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=1024)


def test_q4_k_m_gives_half_the_layers_q6_k_and_the_70b_file_its_real_size() -> None:
    assert sum(use_more_bits(i, 80) for i in range(80)) == 40
    assert sum(use_more_bits(i, 32) for i in range(32)) == 16
    tensors = q4_k_m_tensors(LLAMA3_70B)
    types = {t.name: t.type for t in tensors}
    assert types["output.weight"] == T.Q6_K and types["blk.0.attn_v.weight"] == T.Q6_K
    assert types["blk.10.ffn_down.weight"] == T.Q4_K and types["blk.12.ffn_down.weight"] == T.Q6_K
    total = sum(t.nbytes for t in tensors)
    assert 42.4e9 < total < 42.6e9  # Meta-Llama-3-70B Q4_K_M is 42.5 GB


def test_a_header_only_file_is_planned_as_the_whole_model(tmp_path: Path) -> None:
    path = tmp_path / "small.gguf"
    tensors = write_header_only(path, SMALL)
    model = read_header(path)
    assert (model.layers, model.hidden, model.ffn, model.vocab) == (2, 256, 512, 1024)
    units = unit_table(model)
    assert sum(u.file_bytes for u in units) == sum(t.nbytes for t in tensors)
    assert path.stat().st_size > sum(t.nbytes for t in tensors)


def test_random_weights_have_the_spread_of_an_initialised_model(tmp_path: Path) -> None:
    path = tmp_path / "small.gguf"
    write_random(path, SMALL)
    file = GgufFile(path)
    for name, n_in in (("blk.1.ffn_down.weight", 512), ("blk.0.attn_q.weight", 256)):
        info = file.tensors[name]
        values = np.asarray(dequantize(np.asarray(file.data(name)), info.ggml_type))
        assert abs(float(values.std()) * np.sqrt(n_in) - 1.0) < 0.1
