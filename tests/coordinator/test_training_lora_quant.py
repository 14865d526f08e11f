"""Federated LoRA of a quantized served decoder (QLoRA-style), on the tiny Llama in int8 and int4.

The decoder is exported, stored in int8 (``quantize_dynamic``) or int4 (``MatMulNBits``) by
fedshard's own precision step, split by the planner and trained by the devices' real client code
over the dequantized served weights (two FedAvg rounds, Opacus DP). Asserted: every torch
parameter maps to an initializer (the linear layers to quantized ones, by dequantized value);
the held-out loss drops by 10 % at epsilon <= 8; the merged version changes only the adapted
segment, its adapted weights are bit for bit what ONNX Runtime's own quantizer makes of
``W_deq + (alpha/rank)·B·A``, and its output is the dequantized-merged float model's within the
quantization tolerance; re-quantizing costs almost nothing in held-out loss.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from devtools.lora_lab import LabRun, lora_setup, plan_config, run_rounds, split_version, token_mean
from protocols.lora import METRIC_EPSILON, METRIC_TRAINED_BYTES, LoraPlan, RecordDp, SegmentRef

pytestmark = pytest.mark.slow

FIRST_LAYER = 2
IDS = [101, 2054, 2515, 3899, 2812, 1029, 102]


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_lab(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, LabRun]:
    from partitioner.models.decoders import tiny
    from partitioner.models.decoders.precision import quantize_decoder

    weights = str(request.param)
    root = tmp_path_factory.mktemp(f"qlora-{weights}")
    export = root / "export"
    quantize_decoder(tiny_llama_dir, export, weights)  # type: ignore[arg-type]
    version = split_version(export, root / "v0001")
    model, _ = tiny.llama()
    setup = lora_setup(
        export, version, model, FIRST_LAYER,
        dp=RecordDp(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5),
        max_tokens=24, batch_size=16, learning_rate=0.02, local_epochs=2,
    )  # fmt: skip
    return weights, export, run_rounds(setup, root, 2, 100)


def test_every_parameter_maps_and_linear_layers_to_quantized_weights(
    quantized_lab: tuple[str, Path, LabRun],
) -> None:
    _, _, lab = quantized_lab
    plan = lab.setup.plan
    params = dict(lab.setup.model.named_parameters())
    assert set(plan.weight_map) == set(params)
    for spec in plan.adapters:
        refs = plan.weight_map[f"{spec.module}.weight"]
        assert refs and all(r.quantized is not None for r in refs), (spec.module, refs)
        assert all(r.transpose and r.quantized.shape == [spec.in_features, spec.out_features]
                   for r in refs if r.quantized)  # fmt: skip
    assert "/per_row" not in plan.boundary  # the residual stream, not an int8 row quantizer's
    norms = [k for k in params if k.endswith("layernorm.weight")]
    assert norms and all(plan.weight_map[k][0].quantized is None for k in norms)


def test_training_over_dequantized_weights_helps_within_the_privacy_budget(
    quantized_lab: tuple[str, Path, LabRun],
) -> None:
    _, _, lab = quantized_lab
    before, after = token_mean(lab.baseline), token_mean(lab.final)
    assert after <= 0.9 * before, (before, after)
    last = lab.rounds[-1]
    assert all(0 < m[METRIC_EPSILON] <= 8.0 for _, _, m in last)
    for arrays, _, metrics in last:
        assert sum(a.nbytes for a in arrays) <= 0.02 * metrics[METRIC_TRAINED_BYTES]


def _merged(lab: LabRun, out: Path) -> tuple[object, object]:
    from coordinator.training.lora.version import write_lora_version
    from coordinator.training.version import Version

    parent = Version.load(lab.setup.version_dir)
    merged = write_lora_version(
        parent, lab.setup.plan, lab.arrays, out, rounds=2, clients_per_round=[3, 3], epsilon=1.0
    )
    return parent, merged


def test_merge_requantizes_exactly_as_onnx_runtime_and_changes_one_segment(
    quantized_lab: tuple[str, Path, LabRun], tmp_path: Path
) -> None:
    """Reference: ONNX Runtime's own quantizer run on the float32 graph whose adapted weights
    are ``W_deq + scale·B·A`` (the served weight, dequantized, plus the update)."""
    from partitioner.models.decoders.ort_quantizers import fold_weight_transposes
    from partitioner.models.decoders.precision import quantize_model
    from partitioner.models.lora import adapters_by_module
    from partitioner.models.lora_quant import dequantized

    weights, _, lab = quantized_lab
    plan = lab.setup.plan
    parent, merged = _merged(lab, tmp_path / "v0002")
    changed = [
        a.index for a, b in zip(parent.manifest.segments, merged.manifest.segments, strict=True)
        if a.sha256 != b.sha256
    ]  # fmt: skip
    assert changed == [plan.trainable[0]]
    segment = merged.segments[plan.trainable[0]]
    served = {t.name: t for t in parent.segments[plan.trainable[0]].graph.initializer}
    new = {t.name: t for t in segment.graph.initializer}
    # the float graph ONNX Runtime quantizes: one MatMul per adapted weight, W_deq + update
    adapters = adapters_by_module(plan.adapters, lab.arrays)
    graph_inits, nodes, checked = [], [], 0
    for module, (a, b) in adapters.items():
        ref = next(r for r in plan.weight_map[f"{module}.weight"] if r.initializer in served)
        assert ref.quantized is not None
        w = dequantized(ref.quantized, ref.initializer, served)
        w = w + (plan.lora.scale * (b.astype(np.float64) @ a.astype(np.float64))).T
        base = ref.initializer.removesuffix("_quantized").removesuffix("_Q4")
        graph_inits.append(numpy_helper.from_array(w.astype(np.float32), base))
        nodes.append(onnx.helper.make_node("MatMul", ["x", base], [f"y_{base}"]))
    k = plan.adapters[0].in_features
    graph = onnx.helper.make_graph(
        nodes, "ref",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, k])],
        [onnx.helper.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT, None)
         for n in nodes],
        graph_inits,
    )  # fmt: skip
    reference = quantize_model(
        fold_weight_transposes(onnx.helper.make_model(graph, opset_imports=[
            onnx.helper.make_opsetid("", 21)])), weights,  # type: ignore[arg-type]
    )  # fmt: skip
    for tensor in reference.graph.initializer:
        if tensor.name in new:
            np.testing.assert_array_equal(
                numpy_helper.to_array(new[tensor.name]), numpy_helper.to_array(tensor),
                err_msg=tensor.name,
            )  # fmt: skip
            checked += 1
    assert checked >= 2 * len(adapters), checked  # data and scale (and zero point) of each
    assert any(
        not np.array_equal(numpy_helper.to_array(new[n]), numpy_helper.to_array(served[n]))
        for n in new if n.endswith(("_quantized", "_Q4"))
    )  # fmt: skip


def _chain(segments: list[onnx.ModelProto]) -> np.ndarray:
    """``top_logits`` of the split chain for :data:`IDS` (empty caches)."""
    import onnxruntime as ort

    from partitioner.models.decoders.export import step_feeds

    past = [np.zeros((1, 2, 0, 16), np.float32) for _ in range(8)]
    names = ["input_ids", "attention_mask", "position_ids"] + [
        f"past.{i}.{k}" for i in range(4) for k in ("key", "value")
    ]
    env = dict(zip(names, step_feeds(IDS, past), strict=True))
    for seg in segments:
        session = ort.InferenceSession(seg.SerializeToString())
        outs = session.run(None, {i.name: env[i.name] for i in session.get_inputs()})
        env.update({o.name: v for o, v in zip(session.get_outputs(), outs, strict=True)})
    return np.stack([env["top_ids"][0].astype(np.float32), env["top_logits"][0]])


def _initializers(segments: list[onnx.ModelProto]) -> dict[str, onnx.TensorProto]:
    return {t.name: t for seg in segments for t in seg.graph.initializer}


def _float_reference(
    lab: LabRun, inits: dict[str, onnx.TensorProto], adapters_on: bool
) -> np.ndarray:
    """Logits of the torch model holding the (dequantized) weights of ``inits``, the adapters
    merged in float when ``adapters_on``."""
    import torch

    from partitioner.models.lora import adapters_by_module
    from partitioner.models.lora_quant import dequantized

    plan = lab.setup.plan
    model = lab.setup.model
    state = {}
    for name, refs in plan.weight_map.items():
        ref = refs[-1] if name == "model.embed_tokens.weight" else refs[0]
        if ref.quantized is not None:
            array = dequantized(ref.quantized, ref.initializer, inits)
        else:
            array = numpy_helper.to_array(inits[ref.initializer])
        state[name] = torch.from_numpy(np.ascontiguousarray(array.T if ref.transpose else array))
    if adapters_on:
        for module, (a, b) in adapters_by_module(plan.adapters, lab.arrays).items():
            state[f"{module}.weight"] += torch.from_numpy(plan.lora.scale * (b @ a))
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        logits: np.ndarray = model(torch.tensor([IDS])).logits[0, -1].numpy()
    return logits


def test_merged_version_computes_the_dequantized_merged_model(
    quantized_lab: tuple[str, Path, LabRun], tmp_path: Path
) -> None:
    """Exactly (up to the served graph's own arithmetic) the float model of the weights it
    stores; and those are ``W_deq + scale·B·A`` up to one re-quantization step."""
    weights, _, lab = quantized_lab
    parent, merged = _merged(lab, tmp_path / "v0002")
    base_out, merged_out = _chain(parent.segments), _chain(merged.segments)
    base_ref = _float_reference(lab, _initializers(parent.segments), adapters_on=False)
    ideal = _float_reference(lab, _initializers(parent.segments), adapters_on=True)
    stored = _float_reference(lab, _initializers(merged.segments), adapters_on=False)
    top = merged_out[0].astype(int)
    base_err = np.abs(base_out[1] - base_ref[base_out[0].astype(int)]).max()
    merged_err = np.abs(merged_out[1] - stored[top]).max()
    requant_err = np.abs(stored - ideal).max()
    moved = np.abs(ideal - base_ref).max()
    print(f"{weights}: served graph vs float {base_err:.2e}, merged {merged_err:.2e}; "
          f"re-quantization {requant_err:.3f} of the adapters' {moved:.3f}")  # fmt: skip
    assert merged_err <= 2 * base_err + 1e-3, (merged_err, base_err)
    assert requant_err <= 0.25 * moved, (requant_err, moved)
    assert np.abs(stored - base_ref).max() > 0.5 * moved  # the merge did change the model


def test_requantizing_costs_little_held_out_loss(
    quantized_lab: tuple[str, Path, LabRun], tmp_path: Path
) -> None:
    """Held-out loss of the merged, re-quantized version (zero adapters) vs the served version
    with the unmerged adapters, on the same devices' records."""
    from edge_agent.training.client_app import ShardClient
    from edge_agent.training.local import LocalSettings
    from partitioner.models.lora import initial_adapters

    weights, _, lab = quantized_lab
    plan = lab.setup.plan
    _, merged = _merged(lab, tmp_path / "v0002")
    merged_plan = LoraPlan.model_validate(
        {**plan.model_dump(), "segments": [
            SegmentRef(index=e.index, sha256=e.sha256).model_dump()
            for e in merged.manifest.segments]},
    )  # fmt: skip
    (merged.path / "tokenizer.json").write_bytes(
        (lab.setup.version_dir / "tokenizer.json").read_bytes()
    )
    zero = [a if k % 2 == 0 else np.zeros_like(a)
            for k, a in enumerate(initial_adapters(plan.adapters, plan.lora.rank, 0))]  # fmt: skip
    results = []
    for i, data in enumerate(lab.data_dirs):
        client = ShardClient(LocalSettings(merged.path, data, tmp_path / f"c{i}", 1 << 30), i)
        results.append(client.evaluate(zero, plan_config(merged_plan, 0)))
    requantized, unmerged = token_mean(results), token_mean(lab.final)
    print(f"{weights}: held-out loss unmerged {unmerged:.4f}, merged+requantized {requantized:.4f}")
    assert abs(requantized - unmerged) <= 0.01 * unmerged, (requantized, unmerged)
