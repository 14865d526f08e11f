"""Units of federated LoRA: text records, WordNet shares, the weight map, the adapter merge."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_agent.training.errors import EmptyDataError, MalformedRecordError, OneClassDataError
from edge_agent.training.text_data import is_held_out, load_pairs, load_text
from partitioner.models.lora import (
    adapters_by_module,
    initial_adapters,
    merge_adapters,
    weight_map,
)
from protocols.lora import AdapterSpec, LoraSettings


def _write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path.parent


def _chat(q: str, a: str) -> str:
    return json.dumps(
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    )


def test_chat_text_and_plain_records_load_and_held_out_never_trains(tmp_path: Path) -> None:
    lines = [_chat(f"What is item {i}?", f"Item {i} is a thing.") for i in range(60)]
    d = _write(tmp_path / "d" / "chat.jsonl", lines)
    (d / "notes.txt").write_text("a plain line\n\nanother plain line\n")
    (d / "ignored.csv").write_text("not,read\n")
    records = load_text(d)
    everything = set(records.train) | set(records.held_out)
    assert "user: What is item 3?\nassistant: Item 3 is a thing." in everything
    assert {"a plain line", "another plain line"} <= everything
    assert len(everything) == 62
    assert not set(records.train) & set(records.held_out)
    assert all(is_held_out(t) for t in records.held_out)
    assert records.held_out, "about 10 % of 62 records are held out"


def test_empty_dir_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmptyDataError):
        load_text(tmp_path / "empty")


def test_malformed_record_names_file_and_line(tmp_path: Path) -> None:
    d = _write(tmp_path / "d" / "x.jsonl", [_chat("q", "a"), "{not json", _chat("q2", "a2")])
    with pytest.raises(MalformedRecordError, match=r"x\.jsonl:2"):
        load_text(d)
    d2 = _write(tmp_path / "d2" / "x.jsonl", [json.dumps({"messages": [{"role": "user"}]})])
    with pytest.raises(MalformedRecordError, match=r"x\.jsonl:1"):
        load_text(d2)


def test_one_distinct_record_is_a_typed_error(tmp_path: Path) -> None:
    d = _write(tmp_path / "d" / "x.txt", ["same text"] * 20)
    with pytest.raises(OneClassDataError):
        load_text(d)


def test_pairs_for_encoders_and_not_for_decoders(tmp_path: Path) -> None:
    pairs = [json.dumps({"anchor": f"a{i}", "positive": f"p{i}"}) for i in range(40)]
    d = _write(tmp_path / "d" / "p.jsonl", pairs)
    loaded = load_pairs(d)
    assert len(loaded.train) + len(loaded.held_out) == 40
    with pytest.raises(MalformedRecordError):
        load_text(d)


def test_wordnet_shares_are_real_glosses_by_domain(tmp_path: Path) -> None:
    from devtools.wordnet import glosses, write_shares

    dirs = write_shares(tmp_path, [["noun.animal"], ["noun.food"]], per_device=50)
    animal = (dirs[0] / "wordnet.jsonl").read_text()
    food = (dirs[1] / "wordnet.jsonl").read_text()
    assert len(animal.splitlines()) == len(food.splitlines()) == 50
    assert not set(animal.splitlines()) & set(food.splitlines())
    first_animal = next(g for g in glosses() if g.domain == "noun.animal")
    assert first_animal.gloss in json.loads(animal.splitlines()[0])["messages"][1]["content"]
    load_text(dirs[0])  # the agent reads what the helper writes


def _linear_graph(w_t: np.ndarray) -> onnx.ModelProto:
    """``y = x @ W.T`` as the dynamo exporter writes it: a MatMul with a ``[in, out]`` constant."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "val_7"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", w_t.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", w_t.shape[1]])],
        [numpy_helper.from_array(w_t, "val_7")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_merge_matches_the_adapted_linear_layer() -> None:
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5)).astype(np.float32)  # torch layout [out, in]
    model = _linear_graph(np.ascontiguousarray(w.T))
    wmap = weight_map({"layers.0.proj.weight": w}, model)
    assert wmap["layers.0.proj.weight"][0].transpose
    spec = AdapterSpec(module="layers.0.proj", out_features=6, in_features=5)
    settings = LoraSettings(rank=2, alpha=6.0)
    a, b = initial_adapters([spec], settings.rank, seed=1)
    assert not b.any(), "B starts at zero: the adapted model is the base model"
    b = rng.standard_normal(b.shape).astype(np.float32)
    merged = merge_adapters(model, adapters_by_module([spec], [a, b]), wmap, settings.scale)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    got = ort.InferenceSession(merged.SerializeToString()).run(None, {"x": x})[0]
    want = x @ w.T + settings.scale * (x @ a.T) @ b.T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert [n.op_type for n in merged.graph.node] == ["MatMul"], "only initializers change"


def _secaggplus_mean(
    replies: list[np.ndarray], weights: list[int], max_weight: float
) -> np.ndarray:
    """The weighted mean SecAgg+ hands the strategy, by Flower's own arithmetic (the client mod
    scales by ``weight / max_weight`` and quantizes; the workflow sums, dequantizes, divides)."""
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    clip, levels = 8.0, 4194304  # SecAggPlusWorkflow's defaults, which the LoRA run keeps
    total_q, total = 0, np.zeros_like(replies[0], dtype=np.int64)
    for reply, weight in zip(replies, weights, strict=True):
        q_ratio = round(weight / max_weight * levels)
        total_q += q_ratio
        total += quantize([reply * (q_ratio / levels)], clip, levels)[0]
    (summed,) = dequantize([total], clip, levels)
    return (summed - (len(replies) - 1) * clip) * (levels / total_q)


def test_secagg_keeps_the_adapters_precision_under_dp() -> None:
    from protocols.lora import LoraPlan, RecordDp, SegmentRef, max_reply_weight, reply_weight

    sha = "0" * 64
    plain = LoraPlan(
        run="r", architecture="LlamaForCausalLM", config="{}", first_layer=0, boundary="h",
        segments=[SegmentRef(index=0, sha256=sha)], trainable=[0], weight_map={},
        adapters=[AdapterSpec(module="model.layers.0.self_attn.q_proj", out_features=3,
                              in_features=2)],
        tokenizer_sha256=sha,
    )  # fmt: skip
    private = plain.model_copy(update={"dp": RecordDp()})
    assert reply_weight(private, 5000) == 1 and reply_weight(plain, 40) == 40
    assert reply_weight(plain, 5000) <= max_reply_weight(plain)
    rng = np.random.default_rng(0)
    replies = [rng.normal(0, 0.02, 4096).astype(np.float32) for _ in range(3)]
    exact = np.mean(replies, axis=0)
    weights = [reply_weight(private, 40) for _ in replies]
    kept = np.abs(_secaggplus_mean(replies, weights, max_reply_weight(private)) - exact).max()
    wasted = np.abs(_secaggplus_mean(replies, weights, 1000.0) - exact).max()
    assert kept < 1e-5, kept
    assert wasted > 1e-3, wasted  # what a max_weight of 1000 did to replies that weigh 1
