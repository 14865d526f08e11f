"""``split_model`` end to end on real exports: MiniLM (real weights), a residual CNN, a decoder
stack with tied embeddings, a BERT from the legacy TorchScript exporter and a quantized graph.

Each is planned onto devices too small to hold it in fewer than three, written, and verified:
the chained segments reproduce the whole model in ONNX Runtime.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from hostkit.files import file_sha256
from partitioner.analysis.modelio import initializer_bytes, load_model
from partitioner.analysis.runtime_memory import RuntimeMemory
from partitioner.cutting.inputs import Analysis, SplitOptions
from partitioner.cutting.split import SplitResult, analyse, split_model
from partitioner.cutting.verify import verify_chain
from partitioner.errors import InfeasiblePlanError
from protocols.devices import DeviceList
from protocols.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def devices_for(analysis: Analysis, fractions: list[float], queue_depth: int = 2) -> DeviceList:
    """Devices with ``fraction`` of the model's weights each, plus room for what one stage
    needs beyond weights: the runtime (overhead and arena for the largest workspace) and the
    queued frames."""
    weights = initializer_bytes(analysis.model)
    units = analysis.units
    biggest = max(units.input_bytes, *(u.out_bytes for u in units.units))
    workspace = max(u.workspace_bytes for u in units.units)
    room = RuntimeMemory().stage_bytes(workspace) + 2 * biggest * (1 + queue_depth)
    return DeviceList.from_obj(
        {
            "devices": [
                {
                    "name": f"dev{i}",
                    "memory_bytes": int(f * weights) + room,
                    "gflops": 20.0 + 10 * i,
                    "bandwidth_mbps": 1000.0,
                }
                for i, f in enumerate(fractions)
            ]
        }
    )


def check_split(result: SplitResult, devices: DeviceList, out: Path, segments: int) -> None:
    """Segment count, memory fit, manifest on disk, hashes and the chain's name wiring."""
    manifest = result.manifest
    assert len(manifest.segments) == segments
    memory = {d.name: d.memory_bytes for d in devices.devices}
    assert len({s.device for s in manifest.segments}) == segments
    for seg in manifest.segments:
        assert seg.param_bytes <= memory[seg.device]
        assert seg.param_bytes <= seg.predicted_memory_bytes <= memory[seg.device]
        assert seg.sha256 == file_sha256(out / seg.file)
    on_disk = Manifest.from_json((out / "manifest.json").read_text())
    assert on_disk == manifest
    available = {t.name for t in manifest.model.inputs}
    for seg in manifest.segments:
        assert set(seg.inputs) <= available
        available |= set(seg.outputs)
    assert {t.name for t in manifest.model.outputs} <= available
    assert result.verification is not None
    assert result.verification.max_abs_diff <= 1e-5


def _split(model: Path, fractions: list[float], out: Path) -> tuple[SplitResult, DeviceList]:
    analysis = analyse(load_model(model))
    devices = devices_for(analysis, fractions)
    return split_model(model, devices, out, SplitOptions(verify=True)), devices


# ------------------------------------------------------------------------------------ MiniLM


def test_minilm_needs_all_three_devices_and_matches_the_whole_model(
    minilm_onnx: Path, tmp_path: Path
) -> None:
    out = tmp_path / "minilm"
    result, devices = _split(minilm_onnx, [0.6, 0.3, 0.3], out)
    check_split(result, devices, out, segments=3)
    assert result.analysis.samples_source == "embedded"  # real tokenizer output
    weights = result.manifest.model.param_bytes
    assert result.manifest.segments[0].param_bytes > weights / 2  # the word embedding table
    assert 8 <= len(result.analysis.units.units) <= 128

    from transformers import AutoTokenizer

    from partitioner.models.packaged import minilm_dir

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    sentences = ["Sharding is runtime placement.", "Two", "A much longer sentence " * 6]
    encoded = tokenizer(sentences, padding=True, return_tensors="np")
    feeds = {k: np.asarray(v, dtype=np.int64) for k, v in encoded.items()}
    files = [out / s.file for s in result.manifest.segments]
    check = verify_chain(minilm_onnx, files, [feeds, {k: v[1:2] for k, v in feeds.items()}])
    assert check.max_abs_diff <= 1e-5


def test_minilm_on_two_small_devices_is_infeasible(minilm_onnx: Path, tmp_path: Path) -> None:
    analysis = analyse(load_model(minilm_onnx))
    devices = devices_for(analysis, [0.6, 0.3])
    with pytest.raises(InfeasiblePlanError) as caught:
        split_model(minilm_onnx, devices, tmp_path / "out")
    assert caught.value.shortfall_bytes > 0
    assert not (tmp_path / "out" / "manifest.json").exists()


# ------------------------------------------------------------------------------- other graphs


def _export_dynamo(
    module: Any, args: tuple[Any, ...], names: list[str], out: Path, dims: dict
) -> Path:
    import torch

    torch.onnx.export(
        module.eval(),
        args,
        str(out),
        dynamo=True,
        input_names=names,
        output_names=["out"],
        dynamic_shapes=dims,
        external_data=False,
        verbose=False,
    )
    return out


@pytest.fixture(scope="module")
def resnet_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A residual CNN (transformers' ResNet, random init), dynamo exporter."""
    torch = pytest.importorskip("torch")
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    config = ResNetConfig(
        embedding_size=32, hidden_sizes=[32, 64, 128, 192], depths=[1, 1, 1, 1], layer_type="basic"
    )
    net = ResNetModel(config)

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, pixel_values: Any) -> Any:
            return self.net(pixel_values=pixel_values).pooler_output

    batch = torch.export.Dim("batch")
    out = tmp_path_factory.mktemp("resnet") / "resnet.onnx"
    args = (torch.randn(1, 3, 32, 32),)
    return _export_dynamo(Pooled(), args, ["pixel_values"], out, {"pixel_values": {0: batch}})


@pytest.fixture(scope="module")
def llama_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A decoder block stack (transformers' Llama, random init, tied embeddings), dynamo."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    lm = LlamaForCausalLM(config)

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.lm(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            ).logits

    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    ids = torch.randint(0, 384, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    out = tmp_path_factory.mktemp("llama") / "llama.onnx"
    dims = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    return _export_dynamo(Logits(), (ids, mask), ["input_ids", "attention_mask"], out, dims)


@pytest.fixture(scope="module")
def legacy_bert_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BERT encoder from the legacy TorchScript exporter: Constant nodes, two outputs."""
    torch = pytest.importorskip("torch")
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    bert = BertModel(config).eval()

    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            result = self.bert(input_ids=input_ids, attention_mask=attention_mask)
            return result.last_hidden_state, result.pooler_output

    ids = torch.randint(0, 300, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.int64)
    out = tmp_path_factory.mktemp("legacy") / "bert_legacy.onnx"
    axes = {"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"}}
    axes |= {"last_hidden_state": {0: "b", 1: "s"}, "pooler_output": {0: "b"}}
    torch.onnx.export(
        Both(),
        (ids, mask),
        str(out),
        dynamo=False,
        input_names=["input_ids", "attention_mask"],
        output_names=["last_hidden_state", "pooler_output"],
        dynamic_axes=axes,
        opset_version=17,
        do_constant_folding=False,
    )
    return out


def test_residual_cnn_splits_three_ways(resnet_onnx: Path, tmp_path: Path) -> None:
    result, devices = _split(resnet_onnx, [0.45, 0.45, 0.45], tmp_path / "out")
    check_split(result, devices, tmp_path / "out", segments=3)
    ops = {n.op_type for n in result.analysis.index.nodes}
    assert "Conv" in ops and "Add" in ops


def test_decoder_stack_with_tied_embeddings_counts_the_table_in_both_ends(
    llama_onnx: Path, tmp_path: Path
) -> None:
    result, devices = _split(llama_onnx, [0.45, 0.45, 0.45], tmp_path / "out")
    check_split(result, devices, tmp_path / "out", segments=3)
    shared = result.problem.shared_weights
    assert len(shared) == 1 and len(shared[0].units) == 2
    table = shared[0].name
    segments = result.manifest.segments
    holders = []
    for seg in segments:
        model = onnx.load(str(tmp_path / "out" / seg.file), load_external_data=False)
        holders.append(table in {t.name for t in model.graph.initializer})
    assert holders[0] and holders[-1]
    assert sum(s.param_bytes for s in segments) > result.manifest.model.param_bytes


def test_legacy_exporter_graph_with_constants_and_two_outputs(
    legacy_bert_onnx: Path, tmp_path: Path
) -> None:
    model = load_model(legacy_bert_onnx)
    assert sum(n.op_type == "Constant" for n in model.graph.node) > 50
    result, devices = _split(legacy_bert_onnx, [0.45, 0.45, 0.45], tmp_path / "out")
    check_split(result, devices, tmp_path / "out", segments=3)
    last = result.manifest.segments[-1]
    assert set(last.outputs) == {"last_hidden_state", "pooler_output"}
    for seg in result.manifest.segments:
        seg_model = onnx.load(str(tmp_path / "out" / seg.file))
        consts = {o for n in seg_model.graph.node if n.op_type == "Constant" for o in n.output}
        assert not consts & (set(seg.inputs) | set(seg.outputs))  # constants never handed off


def test_quantized_graph_splits_and_matches(legacy_bert_onnx: Path, tmp_path: Path) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.batches = iter(
                {
                    "input_ids": rng.integers(0, 300, (2, 7)).astype(np.int64),
                    "attention_mask": np.ones((2, 7), np.int64),
                }
                for _ in range(4)
            )

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    quantized = tmp_path / "bert_qdq.onnx"
    quantize_static(
        str(legacy_bert_onnx),
        str(quantized),
        Reader(),
        quant_format=QuantFormat.QDQ,
        weight_type=QuantType.QInt8,
        activation_type=QuantType.QUInt8,
    )
    result, devices = _split(quantized, [0.45, 0.45, 0.45], tmp_path / "out")
    check_split(result, devices, tmp_path / "out", segments=3)
    assert any(n.op_type == "DequantizeLinear" for n in result.analysis.index.nodes)
