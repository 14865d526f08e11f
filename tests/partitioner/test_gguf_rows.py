"""A pass of k tokens through GGUF segments decodes as k one-token steps, bit for bit.

Segments of small random GGUF files (float weights and quantized mixes, whole and cut in three)
are probed with :class:`~partitioner.models.gguf.rows.RowsProbe` stage by stage, as the deploy
does. The same segments with their row padding removed are probed too (float weights: a lone
row then takes ONNX Runtime's matrix-vector kernel), and a run that changes a pass's last bit is
caught.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from devtools.gguf_files import SPECS, write_gguf
from partitioner.models.decoders.rowwise import without_row_padding
from partitioner.models.gguf.builder import GgufSource, build_segment, in_memory
from partitioner.models.gguf.rows import Arrays, RowsProbe
from partitioner.models.gguf.units import segment_range

PROMPT = [5, 17, 256, 99, 3]


def _session(proto: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _run(session: ort.InferenceSession) -> tuple[list[str], object]:
    names = [o.name for o in session.get_outputs()]

    def run(feeds: Mapping[str, np.ndarray]) -> Arrays:
        return dict(zip(names, session.run(names, dict(feeds)), strict=True))

    return [i.name for i in session.get_inputs()], run


def _probe(
    source: GgufSource, cuts: Sequence[int], padded: bool = True, tamper: bool = False
) -> RowsProbe:
    """Probe the chain cut at ``cuts`` (units), prefilling :data:`PROMPT` stage by stage."""
    m = source.model
    empty = np.zeros((1, m.kv_heads, 0, m.head_dim), np.float32)
    known: Arrays = {
        "input_ids": np.asarray([PROMPT], np.int64),
        "attention_mask": np.ones((1, len(PROMPT)), np.int64),
        "position_ids": np.arange(len(PROMPT), dtype=np.int64)[None],
        **{f"past.{i}.{k}": empty for i in range(m.layers) for k in ("key", "value")},
    }
    probe = RowsProbe(len(PROMPT), m.vocab)
    for a, b in itertools.pairwise(cuts):
        proto = build_segment(source, segment_range(m, a, b), in_memory)
        session = _session(proto if padded else without_row_padding(proto))
        inputs, run = _run(session)
        known |= run({n: known[n] for n in inputs})  # type: ignore[operator]
        if tamper:
            plain = run

            def run(feeds: Mapping[str, np.ndarray], plain: object = plain) -> Arrays:
                out: Arrays = plain(feeds)  # type: ignore[operator]
                if feeds["position_ids"].shape[1] > 1:  # a pass: one last bit of one key moved
                    key = next(n for n in out if n.startswith("present."))
                    out[key] = out[key].copy()
                    out[key][0, 0, -1, 0] = np.nextafter(out[key][0, 0, -1, 0], np.inf)
                return out

        probe.stage(run, inputs, known)  # type: ignore[arg-type]
    return probe


@pytest.mark.parametrize(
    ("arch", "mix"),
    [("llama", "f32"), ("llama", "q4_k_m"), ("qwen2", "legacy"), ("gemma3", "kquants"),
     ("phi3", "floats")],
)  # fmt: skip
def test_a_pass_decodes_as_one_token_steps(tmp_path: Path, arch: str, mix: str) -> None:
    source = GgufSource(write_gguf(tmp_path / "m.gguf", SPECS[arch], mix, seed=3))
    units = source.model.layers + 2
    for cuts in ([0, units], [0, 2, units - 1, units]):
        probe = _probe(source, cuts)
        assert probe.alike, probe.difference
        assert probe.difference is None


def test_a_pass_that_differs_in_one_bit_is_caught(tmp_path: Path) -> None:
    source = GgufSource(write_gguf(tmp_path / "m.gguf", SPECS["llama"], "f32", seed=3))
    probe = _probe(source, [0, 2, source.model.layers + 2], tamper=True)
    assert not probe.alike
    assert probe.difference is not None and probe.difference.startswith("stage 0, a pass of 2")


def test_without_the_row_padding_float_products_differ(tmp_path: Path) -> None:
    source = GgufSource(write_gguf(tmp_path / "m.gguf", SPECS["llama"], "f32", seed=3))
    probe = _probe(source, [0, source.model.layers + 2], padded=False)
    assert not probe.alike, "ONNX Runtime's one-row float MatMul now adds as its GEMM does"
