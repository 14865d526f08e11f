"""The :class:`~protocols.lora.LoraPlan` of a served decoder, built on the coordinator.

A plan needs the decoder's transformers architecture and config (devices build the trainable
tail from it) and the weight map (torch parameter -> ONNX initializers). fedshard's decoder
exports record which model they are: ``decoder.json`` next to ``model.onnx``
(:class:`~protocols.decoder.DecoderInfo`: front-door name such as ``tiny-llama`` or
``gemma3-270m``, and architecture). From that name the coordinator loads the torch definition
with :func:`partitioner.decoders.sources.load_source` (offline: the tiny decoders are built from
a seed, the real ones come from the converted-checkpoint cache) once, matches its parameters to
the initializers by value (:func:`partitioner.lora.weight_map`), and keeps only the result, a
:class:`LoraBase` (architecture, config, weight map, parameter shapes; a few hundred KB), in
``STATE/training/lora-base/<model sha256>.json``. The torch model and the graph are dropped
right after; later runs, and every fine-tuned version (which carries its own
:data:`LORA_BASE_FILE`, as merging keeps the initializer names), need no float copy of the model
at all. The boundary tensor is found in the one segment holding the first trained layer.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Final, Literal

import onnx
from pydantic import Field, ValidationError

from coordinator.training.errors import LoraTargetError
from hostkit.files import write_atomic
from protocols.base import FrozenModel
from protocols.decoder import DECODER_FILE, TOKENIZER_FILE, DecoderInfo
from protocols.errors import SchemaError
from protocols.lora import DEFAULT_TARGETS, LoraPlan, LoraSettings, RecordDp, SegmentRef, WeightRef
from protocols.manifest import Manifest
from protocols.training import LoraOptions

log = logging.getLogger(__name__)

LORA_BASE_FILE = "lora-base.json"
LORA_BASE_FORMAT: Final = "fedshard.lora-base/1"


class LoraBase(FrozenModel):
    """What a plan needs of a decoder besides its segments (see the module doc)."""

    format: Literal["fedshard.lora-base/1"] = LORA_BASE_FORMAT
    model: str = Field(min_length=1, max_length=128)
    architecture: str = Field(min_length=1, max_length=128)
    config: str = Field(min_length=2)
    num_layers: int = Field(gt=0)
    weight_map: dict[str, list[WeightRef]]
    shapes: dict[str, list[int]]
    """Every torch parameter's shape."""


class LoraTuning(FrozenModel):
    """The fixed local-training settings of the coordinator's LoRA runs."""

    max_tokens: int = Field(default=24, gt=0)
    batch_size: int = Field(default=16, gt=0)
    learning_rate: float = Field(default=0.02, gt=0)
    local_epochs: int = Field(default=2, gt=0)
    noise_multiplier: float = Field(default=1.0, gt=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    delta: float = Field(default=1e-5, gt=0)


def decoder_info(model_file: Path) -> DecoderInfo:
    """The ``decoder.json`` next to ``model_file``; LoraTargetError when there is none."""
    path = model_file.parent / DECODER_FILE
    try:
        return DecoderInfo.from_json(path.read_bytes())
    except (OSError, SchemaError) as exc:
        raise LoraTargetError(
            f"{model_file} is not a fedshard decoder export (no usable {DECODER_FILE}): {exc}"
        ) from exc


def build_base(model_file: Path, cache_dir: Path) -> LoraBase:
    """Load the decoder's torch definition and match it to ``model_file`` (module doc)."""
    from partitioner.decoders.progress import Steps
    from partitioner.decoders.sources import load_source
    from partitioner.errors import PartitionerError
    from partitioner.lora import torch_params, weight_map

    info = decoder_info(model_file)
    try:
        source = load_source(info.model, cache_dir, Steps())
        params = torch_params(source.model)
        wmap = weight_map(params, onnx.load(model_file))
    except ImportError as exc:
        raise LoraTargetError(
            f"mapping {info.model} needs torch and transformers on the coordinator "
            f"(install fedshard[coordinator,train]): {exc}"
        ) from exc
    except (PartitionerError, OSError) as exc:
        raise LoraTargetError(f"cannot map {info.model} onto {model_file}: {exc}") from exc
    config = source.model.config
    return LoraBase(
        model=info.model,
        architecture=type(source.model).__name__,
        config=config.to_json_string(),
        num_layers=int(config.num_hidden_layers),
        weight_map=wmap,
        shapes={k: list(v.shape) for k, v in params.items()},
    )


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def lora_base(model_file: Path, cache_root: Path, model_cache: Path) -> LoraBase:
    """The :class:`LoraBase` of ``model_file``: its own (a fine-tuned version's), a cached one,
    or built and cached now."""
    for path in (
        model_file.parent / LORA_BASE_FILE,
        cache_root / f"{file_sha256(model_file)}.json",
    ):
        if path.is_file():
            try:
                return LoraBase.from_json(path.read_bytes())
            except (SchemaError, ValidationError) as exc:
                log.warning("ignoring %s: %s", path, exc)
    base = build_base(model_file, model_cache)
    write_atomic(cache_root / f"{file_sha256(model_file)}.json", base.to_json().encode())
    return base


def lora_settings(options: LoraOptions | None) -> LoraSettings:
    """Rank, alpha (default twice the rank) and target modules of a request."""
    options = options or LoraOptions()
    targets = options.target_modules or list(DEFAULT_TARGETS)
    unknown = sorted(set(targets) - set(DEFAULT_TARGETS))
    if unknown:
        raise LoraTargetError(f"unknown target modules {unknown}; known: {list(DEFAULT_TARGETS)}")
    return LoraSettings(
        rank=options.rank, alpha=options.alpha or 2.0 * options.rank, target_modules=targets
    )


def first_layer_of(options: LoraOptions | None, num_layers: int) -> int:
    """The first adapted layer: the request's, or the start of the second half."""
    first = options.first_layer if options and options.first_layer is not None else None
    if first is None:
        return num_layers // 2
    if first >= num_layers:
        raise LoraTargetError(f"first_layer {first}: the decoder has {num_layers} layers")
    return first


def _boundary(version_dir: Path, manifest: Manifest, base: LoraBase, layer: int) -> tuple[int, str]:
    """(index of the segment holding layer ``layer``'s q_proj, the tensor feeding the layer)."""
    from partitioner.errors import PartitionerError
    from partitioner.lora import layer_boundary

    key = next(
        (k for k in base.weight_map if k.endswith(f"layers.{layer}.self_attn.q_proj.weight")), None
    )
    if key is None:
        raise LoraTargetError(f"no q_proj weight of layer {layer} in the weight map")
    names = {r.initializer for r in base.weight_map[key]}
    for entry in manifest.segments:
        segment = onnx.load(version_dir / entry.file)
        if names & {t.name for t in segment.graph.initializer}:
            try:
                return entry.index, layer_boundary(segment, base.weight_map, layer)
            except PartitionerError as exc:
                raise LoraTargetError(f"layer {layer}: {exc}") from exc
        del segment
    raise LoraTargetError(f"no segment of {version_dir} holds layer {layer}")


def build_plan(
    run: str,
    version_dir: Path,
    tokenizer_file: Path,
    base: LoraBase,
    options: LoraOptions | None,
    dp: bool,
    tuning: LoraTuning | None = None,
) -> LoraPlan:
    """The plan that adapts the served version ``version_dir`` (segments as its manifest says)."""
    from partitioner.errors import PartitionerError
    from partitioner.lora import adapter_specs

    tuning = tuning or LoraTuning()
    manifest = Manifest.from_json((version_dir / "manifest.json").read_bytes())
    settings = lora_settings(options)
    first = first_layer_of(options, base.num_layers)
    try:
        specs = adapter_specs(base.shapes, first, settings)
    except PartitionerError as exc:
        raise LoraTargetError(str(exc)) from exc
    first_segment, boundary = _boundary(version_dir, manifest, base, first)
    if not tokenizer_file.is_file():
        raise LoraTargetError(f"the served model has no {TOKENIZER_FILE} ({tokenizer_file})")
    record_dp = (
        RecordDp(
            noise_multiplier=tuning.noise_multiplier,
            max_grad_norm=tuning.max_grad_norm,
            delta=tuning.delta,
        )
        if dp
        else None
    )
    return LoraPlan(
        run=run,
        architecture=base.architecture,
        config=base.config,
        first_layer=first,
        boundary=boundary,
        segments=[SegmentRef(index=e.index, sha256=e.sha256) for e in manifest.segments],
        trainable=list(range(first_segment, len(manifest.segments))),
        weight_map=base.weight_map,
        adapters=specs,
        lora=settings,
        dp=record_dp,
        max_tokens=tuning.max_tokens,
        local_epochs=tuning.local_epochs,
        batch_size=tuning.batch_size,
        learning_rate=tuning.learning_rate,
        tokenizer_sha256=file_sha256(tokenizer_file),
    )
