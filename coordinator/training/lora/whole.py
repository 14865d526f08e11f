"""The whole merged model of a LoRA version, so that the version can be re-planned.

A failover re-plans a served version from the model file it came from
(:attr:`~coordinator.deploy.store.VersionRecord.source`). A LoRA version therefore carries its
own ``model.onnx``: the parent's whole model with the same adapters merged (same initializer
names, same metadata: the decoder description and the sample inputs), beside copies of the
parent's ``decoder.json`` and tokenizer files, and the :class:`~.plan.LoraBase` it was
planned with (the next run plans from it without loading torch).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx

from coordinator.training.lora.plan import LORA_BASE_FILE, LoraBase
from hostkit.files import write_atomic
from partitioner.models.lora import adapters_by_module, merge_adapters
from protocols.decoder import MODEL_FILE
from protocols.lora import LoraPlan

SIDE_FILES = ("decoder.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_whole_model(
    parent_model: Path, plan: LoraPlan, base: LoraBase, arrays: Sequence[np.ndarray], out: Path
) -> Path:
    """Write ``out/model.onnx`` (merged) and its side files; the model path."""
    adapters = adapters_by_module(plan.adapters, arrays)
    merged = merge_adapters(onnx.load(parent_model), adapters, plan.weight_map, plan.lora.scale)
    path = out / MODEL_FILE
    onnx.save(merged, path)
    for name in SIDE_FILES:
        src = parent_model.parent / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    write_atomic(out / LORA_BASE_FILE, base.to_json().encode())
    return path
