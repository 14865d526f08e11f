"""Decoders with a KV cache: state pairs are found by structure, each layer's cache stays on its
stage (never in a hand-off), masks and positions are rebuilt per stage, KV memory is planned."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from graph_helpers import token_decoder, token_decoder_feeds

from coordinator.deploy.plan import forward_names
from partitioner.analysis.decoding import decoder_layout, find_state_pairs
from partitioner.analysis.graph import index_graph
from partitioner.analysis.modelio import save_model
from partitioner.analysis.runtime_memory import GRAPH_ONLY
from partitioner.cutting.inputs import SplitOptions
from partitioner.cutting.split import analyse, split_model
from partitioner.cutting.verify import run_model
from partitioner.errors import InfeasiblePlanError
from protocols.devices import DeviceList
from protocols.manifest import SessionLimits

LAYERS = 4
KV_PER_TOKEN = 2 * 4 * 4  # [1, 2, past, 4] float32


def _renamed(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with every tensor name replaced by an opaque one."""
    names: dict[str, str] = {}

    def new(name: str) -> str:
        return names.setdefault(name, f"t{len(names)}") if name else name

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for value in [*g.input, *g.output]:
        value.name = new(value.name)
    for init in g.initializer:
        init.name = new(init.name)
    for node in g.node:
        node.input[:] = [new(n) for n in node.input]
        node.output[:] = [new(n) for n in node.output]
    return out


def test_state_pairs_are_found_by_structure_not_names() -> None:
    model = token_decoder(LAYERS)
    pairs = find_state_pairs(model.graph)
    assert [(p.past, p.present, p.axis) for p in pairs] == [
        (f"past.{i}.key", f"present.{i}.key", 2) for i in range(LAYERS)
    ]
    assert len(find_state_pairs(_renamed(model).graph)) == LAYERS
    layout = decoder_layout(model)
    assert layout is not None
    assert set(layout.bytes_per_token.values()) == {KV_PER_TOKEN}


def test_only_the_hidden_state_crosses_between_layers() -> None:
    model, feeds = token_decoder(LAYERS), token_decoder_feeds(LAYERS)
    analysis = analyse(model, samples=feeds)
    assert not analysis.frontier.carry_io
    crossings = [analysis.frontier.crossing(u.end) for u in analysis.units.units[:-1]]
    assert all(len(c) == 1 and c[0].startswith("h") for c in crossings), crossings
    # without replication the mask and position terms are main nodes read by every layer
    plain = index_graph(model.graph)
    mask_node = plain.producer["mask_term"]
    assert mask_node not in plain.static
    assert mask_node in analysis.index.static


def _devices(memory: int) -> DeviceList:
    return DeviceList.from_obj(
        {
            "devices": [
                {"name": f"dev{i}", "memory_bytes": memory, "gflops": 10.0, "bandwidth_mbps": 1e3}
                for i in range(3)
            ]
        }
    )


def _split(tmp_path: Path, sessions: SessionLimits, memory: int):  # type: ignore[no-untyped-def]
    model_path = tmp_path / "decoder.onnx"
    save_model(token_decoder(LAYERS), model_path)
    feeds = token_decoder_feeds(LAYERS)
    np.savez(tmp_path / "samples.npz", **feeds)
    options = SplitOptions(
        verify=True, sessions=sessions, runtime=GRAPH_ONLY, samples_path=tmp_path / "samples.npz"
    )
    return split_model(model_path, _devices(memory), tmp_path / "out", options)


def test_three_stages_keep_their_own_cache_and_match_the_whole_model(tmp_path: Path) -> None:
    sessions = SessionLimits(max_sessions=4, max_context=1000)
    per_layer = KV_PER_TOKEN * 4 * 1000
    # the table (160 kB) sits at both ends; two layers' cache more than fills a device
    result = _split(tmp_path, sessions, memory=160_000 + per_layer + 60_000)
    manifest = result.manifest
    assert result.verification is not None
    assert result.verification.max_abs_diff <= result.verification.tolerance
    assert len(manifest.segments) == 3
    assert manifest.sessions == sessions
    kept = [p.past for s in manifest.segments for p in s.state]
    assert sorted(kept) == [f"past.{i}.key" for i in range(LAYERS)]
    for seg in manifest.segments:
        assert seg.state_bytes == per_layer * len(seg.state)
        assert seg.state_bytes <= seg.predicted_memory_bytes
        for pair in seg.state:
            assert pair.past in seg.inputs and pair.present in seg.outputs
    for k in range(3):
        forward = forward_names(manifest, k)
        assert not any(name.startswith(("past.", "present.")) for name in forward)
    assert forward_names(manifest, 2) == ["logits"]


def test_whole_model_outputs_equal_chained_segments_with_fresh_cache(tmp_path: Path) -> None:
    """A prefill (empty past) through the chain, fed as an agent would feed each stage."""
    sessions = SessionLimits(max_sessions=1, max_context=64)
    result = _split(tmp_path, sessions, memory=200_000)
    feeds = token_decoder_feeds(LAYERS, q=4, past=0)
    whole = run_model(tmp_path / "decoder.onnx", feeds)
    tensors = dict(feeds)
    for seg in result.manifest.segments:
        got = run_model(tmp_path / "out" / seg.file, {n: tensors[n] for n in seg.inputs})
        tensors.update(got)
    np.testing.assert_allclose(tensors["logits"], whole["logits"], rtol=1e-5, atol=1e-5)
    for i in range(LAYERS):
        assert tensors[f"present.{i}.key"].shape == (1, 2, 4, 4)


def test_too_many_sessions_fail_with_the_kv_cache_named(tmp_path: Path) -> None:
    with pytest.raises(InfeasiblePlanError, match="KV cache") as caught:
        _split(tmp_path, SessionLimits(max_sessions=64, max_context=4096), memory=400_000)
    assert "64 concurrent session" in str(caught.value)
    assert caught.value.shortfall_bytes > 0
