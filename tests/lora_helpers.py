"""Federated LoRA fixtures: a tiny decoder split by the planner, its LoRA plan, WordNet shares,
and plain FedAvg rounds over the agents' real client code (no Flower processes)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from partitioner.lora import (
    adapter_specs,
    initial_adapters,
    layer_boundary,
    torch_params,
    weight_map,
)
from protocols.lora import LoraPlan, LoraSettings, RecordDp, SegmentRef
from protocols.manifest import Manifest

DOMAINS = (("noun.animal",), ("noun.food",), ("noun.plant",))
"""One WordNet domain per device: non-IID shares."""
DEVICES = {
    "devices": [
        {"name": n, "memory_bytes": 16_000_000, "gflops": 10, "bandwidth_mbps": 1000}
        for n in ("a", "b", "c")
    ]
}


@dataclass(frozen=True)
class LoraSetup:
    """A split version dir (with tokenizer), the full model's torch params and the plan."""

    version_dir: Path
    plan: LoraPlan
    initial: list[np.ndarray]
    model: Any


def split_version(export_dir: Path, out_dir: Path) -> Path:
    """``fedshard split`` the export onto :data:`DEVICES`; copy its tokenizer next to it."""
    from partitioner.split import split_model
    from protocols.devices import DeviceList

    devices = DeviceList.model_validate(DEVICES)
    split_model(export_dir / "model.onnx", devices, out_dir)
    shutil.copy(export_dir / "tokenizer.json", out_dir / "tokenizer.json")
    return out_dir


def lora_setup(
    export_dir: Path,
    version_dir: Path,
    model: Any,
    first_layer: int,
    *,
    dp: RecordDp | None,
    settings: LoraSettings | None = None,
    run: str = "test-run",
    **plan_fields: Any,
) -> LoraSetup:
    """The plan that adapts layers ``first_layer ..`` of the split ``version_dir``."""
    settings = settings or LoraSettings(rank=4, alpha=8.0)
    full = onnx.load(export_dir / "model.onnx")
    params = torch_params(model)
    wmap = weight_map(params, full)
    boundary = layer_boundary(full, wmap, first_layer)
    manifest = Manifest.from_json((version_dir / "manifest.json").read_bytes())
    q_name = wmap[f"model.layers.{first_layer}.self_attn.q_proj.weight"][0].initializer
    first_trainable = next(
        e.index
        for e in manifest.segments
        if q_name in {t.name for t in onnx.load(version_dir / e.file).graph.initializer}
    )
    specs = adapter_specs({k: v.shape for k, v in params.items()}, first_layer, settings)
    plan = LoraPlan(
        run=run,
        architecture=type(model).__name__,
        config=model.config.to_json_string(),
        first_layer=first_layer,
        boundary=boundary,
        segments=[SegmentRef(index=e.index, sha256=e.sha256) for e in manifest.segments],
        trainable=list(range(first_trainable, len(manifest.segments))),
        weight_map={k: list(v) for k, v in wmap.items()},
        adapters=specs,
        lora=settings,
        dp=dp,
        tokenizer_sha256=hashlib.sha256((version_dir / "tokenizer.json").read_bytes()).hexdigest(),
        **plan_fields,
    )
    return LoraSetup(version_dir, plan, initial_adapters(specs, settings.rank, seed=0), model)


def fedavg(replies: Sequence[Sequence[np.ndarray]], weights: Sequence[float]) -> list[np.ndarray]:
    """Weighted mean of each array over the replies."""
    total = float(sum(weights))
    return [
        (
            sum(w * np.asarray(r[k], np.float64) for r, w in zip(replies, weights, strict=True))
            / total
        ).astype(np.float32)
        for k in range(len(replies[0]))
    ]


def plan_config(plan: LoraPlan, round_number: int) -> dict[str, Any]:
    """The fit config a ServerApp sends for a LoRA round."""
    from protocols.lora import LORA_PLAN_KEY

    return {LORA_PLAN_KEY: plan.model_dump_json(), "round": round_number}


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
