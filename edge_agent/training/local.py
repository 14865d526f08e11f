"""Local fine-tuning of the shards that fit this device's training budget.

- **Which shards.** The server's plan lists the trainable shards. This device trains the largest
  *suffix* of them whose training memory fits its budget: for every segment from the first
  trained one to the end (all run in torch), the weights, plus for the trained ones their
  gradients and optimizer state (SGD momentum), plus the activations of a batch and their
  gradients. A device whose budget fits none trains nothing and returns the weights unchanged.
- **Frozen features.** Segments before the first trainable shard never change during a run: they
  run in ONNX Runtime one segment at a time and their output is cached on disk (keyed by the
  segment hashes and the data's hash). Trainable shards this device does not train run in torch
  without gradients, with the round's global weights.
- **Privacy.** Only weights leave: the training data is read here and never sent.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from edge_agent.training.errors import PlanMismatchError, TrainDataError
from edge_agent.training.ledger import PrivacyPolicy
from protocols.errors import SchemaError
from protocols.manifest import Manifest
from protocols.training import TRAIN_DATA_FILE, TrainPlan

if TYPE_CHECKING:
    from edge_agent.training.onnx_torch import OnnxSegmentModule

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
OPTIMIZER_SLOTS = 1
"""SGD with momentum keeps one extra tensor per weight."""


@dataclass(frozen=True)
class LocalSettings:
    """Where this device keeps its segments, data and cache, and how much it may use."""

    segments_dir: Path
    data_dir: Path
    cache_dir: Path
    budget_bytes: int
    privacy: PrivacyPolicy | None = None
    """The ledger and what the operator allows (``fedshard agent``); None: no ledger is kept
    and nothing is declined (labs and tests that run ClientApps by hand)."""


@dataclass(frozen=True)
class LocalResult:
    """What a round of local training produced."""

    arrays: list[np.ndarray]
    trained: list[int]
    examples: int
    loss: float
    accuracy: float


def load_train_data(data_dir: Path) -> tuple[np.ndarray, np.ndarray, str]:
    """``x`` (float32), ``y`` (int64) and the file's SHA-256 from ``DIR/data.npz`` (no pickle)."""
    path = data_dir / TRAIN_DATA_FILE
    try:
        raw = path.read_bytes()
        with np.load(io.BytesIO(raw), allow_pickle=False) as data:
            x, y = data["x"].astype(np.float32), data["y"].astype(np.int64)
    except (OSError, ValueError, KeyError) as exc:
        raise TrainDataError(f"{path}: cannot read x/y arrays: {exc}") from exc
    if len(x) != len(y) or len(y) == 0:
        raise TrainDataError(f"{path}: x has {len(x)} rows and y {len(y)}")
    return x, y, hashlib.sha256(raw).hexdigest()


def load_segments(segments_dir: Path, plan: TrainPlan) -> tuple[Manifest, list[onnx.ModelProto]]:
    """The local segments, checked against the manifest and against the plan's hashes."""
    try:
        manifest = Manifest.from_json((segments_dir / MANIFEST_FILE).read_bytes())
    except (OSError, SchemaError) as exc:
        raise PlanMismatchError(f"{segments_dir}: no usable manifest: {exc}") from exc
    by_index = {s.index: s for s in manifest.segments}
    for shard in plan.shards:
        entry = by_index.get(shard.index)
        if entry is None or entry.sha256 != shard.sha256:
            raise PlanMismatchError(f"segment {shard.index} differs from the server's version")
    segments = []
    for entry in manifest.segments:
        data = (segments_dir / entry.file).read_bytes()
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise PlanMismatchError(f"{entry.file}: SHA-256 differs from the manifest")
        segments.append(onnx.load_from_string(data))
    return manifest, segments


def frozen_prefix(
    manifest: Manifest,
    segments: list[onnx.ModelProto],
    stop: int,
    x: np.ndarray,
    data_sha256: str,
    cache_dir: Path,
) -> dict[str, np.ndarray]:
    """Outputs of segments ``0..stop-1`` (ONNX Runtime, one at a time), cached on disk."""
    import onnxruntime as ort

    input_name = manifest.model.inputs[0].name
    if stop == 0:
        return {input_name: x}
    key = hashlib.sha256(
        ("|".join(s.sha256 for s in manifest.segments[:stop]) + "|" + data_sha256).encode()
    ).hexdigest()
    path = cache_dir / f"features-{key}.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as data:
            names = [str(n) for n in data["names"]]
            return {n: data[f"t{i}"] for i, n in enumerate(names)}
    env = {input_name: x}
    for seg in segments[:stop]:
        session = ort.InferenceSession(seg.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {i.name: env[i.name] for i in session.get_inputs()}
        for meta, value in zip(session.get_outputs(), session.run(None, feeds), strict=True):
            env[meta.name] = np.asarray(value)
    needed = {i.name for seg in segments[stop:] for i in seg.graph.input} & set(env)
    names = sorted(needed)
    cache_dir.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    arrays: dict[str, Any] = {f"t{i}": env[n] for i, n in enumerate(names)}
    np.savez(buf, names=np.array(names), **arrays)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)
    log.info("cached frozen features of segments 0..%d in %s", stop - 1, path.name)
    return {n: env[n] for n in names}


def split_arrays(plan: TrainPlan, arrays: list[np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    """Wire-order arrays to ``{segment: {initializer: array}}``, checking shapes."""
    if len(arrays) != plan.num_arrays:
        raise PlanMismatchError(f"{len(arrays)} arrays for a plan of {plan.num_arrays}")
    out: dict[int, dict[str, np.ndarray]] = {}
    k = 0
    for shard in plan.shards:
        out[shard.index] = {}
        for param in shard.params:
            if list(arrays[k].shape) != param.shape:
                raise PlanMismatchError(f"{param.name}: shape {arrays[k].shape} != {param.shape}")
            out[shard.index][param.name] = arrays[k]
            k += 1
    return out


def train_locally(
    plan: TrainPlan, arrays: list[np.ndarray], settings: LocalSettings, seed: int
) -> LocalResult:
    """One round of local training; returns every plan array (trained ones updated)."""
    import torch

    from edge_agent.training.onnx_torch import OnnxSegmentModule

    x, y, data_sha = load_train_data(settings.data_dir)
    manifest, segments = load_segments(settings.segments_dir, plan)
    weights = split_arrays(plan, arrays)
    first_plan = plan.shards[0].index
    features = frozen_prefix(manifest, segments, first_plan, x, data_sha, settings.cache_dir)
    modules = []
    for index in range(first_plan, len(segments)):
        module = OnnxSegmentModule(segments[index])
        if index in weights:
            module.load_arrays(weights[index])
        modules.append(module)
    trained = choose_shards(plan, modules, features, settings.budget_bytes)
    if not trained:
        log.warning("the training budget fits no shard; sending the weights back unchanged")
        return LocalResult(list(arrays), [], len(y), float("nan"), float("nan"))
    torch.manual_seed(seed)
    inputs = [torch.from_numpy(features[n]) for n in modules[0].input_names]
    target = torch.from_numpy(y)
    with torch.no_grad():  # shards before the first trained one stay frozen this round
        frozen_out: tuple[torch.Tensor, ...] = tuple(inputs)
        for module in modules[: trained[0] - first_plan]:
            out = module(*frozen_out)
            frozen_out = out if isinstance(out, tuple) else (out,)
    live = modules[trained[0] - first_plan :]
    params: list[torch.nn.Parameter] = []
    for offset, module in enumerate(live):
        if trained[0] + offset in trained:
            params.extend(module.parameters())
        else:
            module.requires_grad_(False)
    optimizer = torch.optim.SGD(params, lr=plan.learning_rate, momentum=0.9)
    loss_sum, correct, seen = 0.0, 0, 0
    for _ in range(plan.local_epochs):
        loss_sum, correct, seen = 0.0, 0, 0
        order = torch.randperm(len(target))
        for start in range(0, len(target), plan.batch_size):
            batch = order[start : start + plan.batch_size]
            h: tuple[torch.Tensor, ...] = tuple(t[batch] for t in frozen_out)
            for module in live:
                out = module(*h)
                h = out if isinstance(out, tuple) else (out,)
            logits = h[0]
            loss = torch.nn.functional.cross_entropy(logits, target[batch])
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            loss_sum += float(loss.detach()) * len(batch)
            correct += int((logits.argmax(1) == target[batch]).sum())
            seen += len(batch)
    new = {index: modules[index - first_plan].arrays() for index in trained}
    out_arrays = [
        new[shard.index][p.name] if shard.index in new else weights[shard.index][p.name]
        for shard in plan.shards
        for p in shard.params
    ]
    return LocalResult(out_arrays, trained, len(y), loss_sum / seen, correct / seen)


def choose_shards(
    plan: TrainPlan,
    modules: Sequence[OnnxSegmentModule],
    features: dict[str, np.ndarray],
    budget_bytes: int,
) -> list[int]:
    """The largest suffix of the plan's shards whose training memory fits ``budget_bytes``."""
    import torch

    first_plan = plan.shards[0].index
    sample: tuple[torch.Tensor, ...] = tuple(
        torch.from_numpy(features[n][:1]) for n in modules[0].input_names
    )
    param_bytes, act_bytes = [], []
    for module in modules:
        param_bytes.append(sum(p.numel() * 4 for p in module.parameters()))
        act_bytes.append(module.activation_elements(*sample) * 4 * plan.batch_size)
        with torch.no_grad():
            out = module(*sample)
        sample = out if isinstance(out, tuple) else (out,)
    best: list[int] = []
    candidates = [s.index for s in plan.shards]
    for k in range(len(candidates) - 1, -1, -1):
        trained = candidates[k:]
        start = trained[0] - first_plan
        need = 0
        for offset in range(start, len(modules)):
            is_trained = first_plan + offset in trained
            need += param_bytes[offset] * ((2 + OPTIMIZER_SLOTS) if is_trained else 1)
            need += act_bytes[offset] * 2
        if need > budget_bytes:
            break
        best = trained
    return best
