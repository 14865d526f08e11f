"""A pass of k tokens through GGUF segments decodes as k one-token steps, bit for bit.

Segments of small random GGUF files (float weights and quantized mixes, whole and cut in three)
are probed with :class:`~partitioner.models.gguf.rows.RowsProbe` stage by stage, as the deploy
does; also after long prompts with a head size of 256 on one thread, where scores computed as
``q @ k^T`` differed once a pass saw 65 keys and its step 64 (MLAS picks its K blocking from
the column count); and a run that changes a pass's last bit is caught.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from devtools.gguf_files import SPECS, Spec, write_gguf
from partitioner.models.gguf.builder import GgufSource, build_segment, in_memory
from partitioner.models.gguf.rows import REACH, Arrays, RowsProbe
from partitioner.models.gguf.units import segment_range

PROMPT = [5, 17, 256, 99, 3]


def _session(proto: onnx.ModelProto, threads: int = 0) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    return ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _run(session: ort.InferenceSession) -> tuple[list[str], object]:
    names = [o.name for o in session.get_outputs()]

    def run(feeds: Mapping[str, np.ndarray]) -> Arrays:
        return dict(zip(names, session.run(names, dict(feeds)), strict=True))

    return [i.name for i in session.get_inputs()], run


def _probe(
    source: GgufSource,
    cuts: Sequence[int],
    tamper: bool = False,
    prompt: Sequence[int] = PROMPT,
    threads: int = 0,
    reach: tuple[int, ...] = (),
) -> RowsProbe:
    """Probe the chain cut at ``cuts`` (units), prefilling ``prompt`` stage by stage."""
    m = source.model
    empty = np.zeros((1, m.kv_heads, 0, m.head_dim), np.float32)
    known: Arrays = {
        "input_ids": np.asarray([prompt], np.int64),
        "attention_mask": np.ones((1, len(prompt)), np.int64),
        "position_ids": np.arange(len(prompt), dtype=np.int64)[None],
        **{f"past.{i}.{k}": empty for i in range(m.layers) for k in ("key", "value")},
    }
    probe = RowsProbe(len(prompt), m.vocab, reach=reach)
    for a, b in itertools.pairwise(cuts):
        proto = build_segment(source, segment_range(m, a, b), in_memory)
        session = _session(proto, threads)
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
        probe = _probe(source, cuts, reach=REACH if mix == "q4_k_m" else ())
        assert probe.alike, probe.difference
        assert probe.difference is None


def test_a_pass_that_differs_in_one_bit_is_caught(tmp_path: Path) -> None:
    source = GgufSource(write_gguf(tmp_path / "m.gguf", SPECS["llama"], "f32", seed=3))
    probe = _probe(source, [0, 2, source.model.layers + 2], tamper=True)
    assert not probe.alike
    assert probe.difference is not None
    assert probe.difference.startswith("stage 0, 5 tokens then a pass of 2")


@pytest.mark.parametrize("mix", ["f32", "q4_k_m"])
def test_long_contexts_decode_alike_on_one_thread(tmp_path: Path, mix: str) -> None:
    spec = Spec("llama", layers=1, hidden=512, heads=2, kv_heads=1, head_dim=256, ffn=512)
    source = GgufSource(write_gguf(tmp_path / "m.gguf", spec, mix, seed=5))
    for length in (60, 124):  # passes and steps around 64 and 128 keys
        prompt = [(7919 * i + 3) % spec.vocab for i in range(length)]
        probe = _probe(source, [0, 3], prompt=prompt, threads=1)
        assert probe.alike, f"{length}: {probe.difference}"
