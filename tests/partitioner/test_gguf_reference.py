"""The numpy GGUF reference against transformers' own GGUF loader, on the same small files.

transformers reads a GGUF independently (it un-permutes llama's Q/K rows, subtracts 1 from
Gemma's stored norms, builds its own RoPE and masks), so agreement here checks the semantics the
builder is tested against. Gemma 3's ``query_pre_attn_scalar`` is not in GGUF metadata:
transformers defaults to 256 while llama.cpp scales by ``1 / sqrt(head_dim)``; real Gemma 3
models have both equal to the head size, so it is set to the test file's head size here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from devtools.gguf_files import SPECS, write_gguf
from partitioner.models.gguf import reference
from partitioner.models.gguf.builder import GgufSource

TOKENS = [5, 17, 256, 99, 3, 42, 7]
TOL = 1e-5
"""max |transformers - reference| / max |reference| over every position's logits, float32
against float64 (measured 7e-8 to 5e-7)."""


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_reference_matches_transformers(tmp_path: Path, arch: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    spec = SPECS[arch]
    path = write_gguf(tmp_path / f"{arch}.gguf", spec, "f32", seed=3)
    overrides: dict[str, object] = {"pad_token_id": 0}
    if arch == "gemma3":
        overrides["query_pre_attn_scalar"] = spec.head_dim
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, **overrides
    ).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([TOKENS])).logits[0].double().numpy()
    source = GgufSource(path)
    ours = reference.forward(source.model, reference.dequantized(source.model, source.raw), TOKENS)
    assert np.abs(theirs - ours).max() <= TOL * np.abs(ours).max()
    assert list(theirs.argmax(axis=1)) == list(ours.argmax(axis=1))
