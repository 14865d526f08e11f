"""The trainable tail of a decoder in torch: transformers' own layer modules, PEFT LoRA adapters.

A :class:`~protocols.lora.LoraPlan` names the architecture, its config (JSON data) and the first
decoder layer that runs here. :func:`build_tail` builds transformers' modules for layers
``first_layer ..`` plus the final norm and the LM head on the ``meta`` device, then assigns
their weights straight from the segments' ONNX initializers (through the plan's weight map, so
no copy of a weight is made twice), freezes them and injects PEFT LoRA adapters into the target
linear layers. Only the adapters require gradients. No model code travels: only known
architectures are built, from transformers' installed modules.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_agent.training.errors import PlanMismatchError
from protocols.lora import AdapterSpec, LoraPlan, WeightRef

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "Llama"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3"),
}
"""transformers class -> (module under ``transformers.models``, class prefix)."""
ADAPTER = "default"


def _classes(architecture: str) -> tuple[Any, Any, Any, Any]:
    """(config class, decoder layer, RMS norm, rotary embedding) of a known architecture."""
    import importlib

    if architecture not in ARCHITECTURES:
        raise PlanMismatchError(f"cannot train {architecture!r}: known are {sorted(ARCHITECTURES)}")
    package, prefix = ARCHITECTURES[architecture]
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    configuration = importlib.import_module(
        f"transformers.models.{package}.configuration_{package}"
    )
    config_name = "Gemma3TextConfig" if package == "gemma3" else f"{prefix}Config"
    return (
        getattr(configuration, config_name),
        getattr(modeling, f"{prefix}DecoderLayer"),
        getattr(modeling, f"{prefix}RMSNorm"),
        getattr(modeling, f"{prefix}RotaryEmbedding"),
    )


def causal_masks(length: int, sliding_window: int | None) -> dict[str, torch.Tensor]:
    """Additive ``[1, 1, q, q]`` masks by layer type (causal; sliding also within the window)."""
    pos = torch.arange(length)
    allowed = pos[None, :] <= pos[:, None]
    blocked = torch.tensor(torch.finfo(torch.float32).min)
    zero = torch.tensor(0.0)
    masks = {"full_attention": torch.where(allowed, zero, blocked)[None, None]}
    if sliding_window is not None:
        window = allowed & (pos[None, :] > pos[:, None] - sliding_window)
        masks["sliding_attention"] = torch.where(window, zero, blocked)[None, None]
    return masks


class DecoderTail(nn.Module):
    """Decoder layers ``first_layer ..`` + final norm + LM head: residual stream in, logits out."""

    def __init__(self, config: Any, first_layer: int, classes: tuple[Any, Any, Any, Any]) -> None:
        super().__init__()
        _, layer_class, norm_class, rotary_class = classes
        self.config = config
        self.first_layer = first_layer
        self.layer_types: list[str] = list(
            getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        )
        with torch.device("meta"):
            self.layers = nn.ModuleList(
                layer_class(config, i) for i in range(first_layer, config.num_hidden_layers)
            )
            self.norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = rotary_class(config)
        self.per_type_rotary = "gemma3" in str(config.model_type)
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, q, vocab]`` for the residual stream ``hidden`` ``[batch, q, h]``."""
        window = getattr(self.config, "sliding_window", None)
        masks = causal_masks(hidden.shape[1], window if window else None)
        rotary: dict[str, Any] = {}
        for kind in set(self.layer_types):
            rotary[kind] = (
                self.rotary(hidden, position_ids, kind)
                if self.per_type_rotary
                else self.rotary(hidden, position_ids)
            )
        for offset, layer in enumerate(self.layers):
            kind = self.layer_types[self.first_layer + offset]
            out = layer(
                hidden,
                attention_mask=masks.get(kind, masks["full_attention"]),
                position_ids=position_ids,
                position_embeddings=rotary[kind],
            )
            hidden = out[0] if isinstance(out, tuple) else out
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def local_name(name: str, first_layer: int) -> str | None:
    """Torch parameter name of the full model -> its name in :class:`DecoderTail` (or None)."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        layer = int(parts[2])
        return (
            None
            if layer < first_layer
            else ".".join(["layers", str(layer - first_layer), *parts[3:]])
        )
    if parts[:2] == ["model", "norm"]:
        return ".".join(["norm", *parts[2:]])
    if parts[0] == "lm_head":
        return name
    return None


def _tied_head(weight_map: Mapping[str, Sequence[WeightRef]]) -> dict[str, list[WeightRef]]:
    """A tied LM head has no ``lm_head.weight`` parameter: it reads the embedding's, the head's
    own (transposed) table first (a quantized decoder stores the head and the embedding table
    each quantized its own way; the tail computes with what the served head does)."""
    out = {name: list(refs) for name, refs in weight_map.items()}
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        refs = out["model.embed_tokens.weight"]
        out["lm_head.weight"] = sorted(refs, key=lambda r: not r.transpose)
    return out


def _namer(plan: LoraPlan) -> Callable[[str, int], str | None]:
    """The full-model -> tail parameter naming of the plan's architecture."""
    from edge_agent.training.lora.encoder import ENCODERS, encoder_local_name

    return encoder_local_name if plan.architecture in ENCODERS else local_name


def tail_initializers(plan: LoraPlan) -> set[str]:
    """Every initializer name that may hold a weight of the tail."""
    namer = _namer(plan)
    return {
        ref.initializer
        for name, refs in _tied_head(plan.weight_map).items()
        if namer(name, plan.first_layer) is not None
        for ref in refs
    }


def _modules(plan: LoraPlan) -> nn.Module:
    """The tail's modules on ``meta``: an encoder's BERT layers or a decoder's layers + head."""
    from edge_agent.training.lora.encoder import ENCODERS, build_encoder_tail

    if plan.architecture in ENCODERS:
        return build_encoder_tail(plan.architecture, plan.config, plan.first_layer)
    classes = _classes(plan.architecture)
    config = classes[0].from_dict(json.loads(plan.config))
    config._attn_implementation = "eager"
    return DecoderTail(config, plan.first_layer, classes)


def build_tail(plan: LoraPlan, initializers: Mapping[str, np.ndarray]) -> Any:
    """The frozen tail with its weights from ``initializers`` and LoRA adapters injected."""
    from peft import LoraConfig, inject_adapter_in_model

    tail = _modules(plan)
    namer = _namer(plan)
    state: dict[str, torch.Tensor] = {}
    for name, refs in _tied_head(plan.weight_map).items():
        local = namer(name, plan.first_layer)
        if local is None:
            continue
        ref = next((r for r in refs if r.initializer in initializers), None)
        if ref is None:
            raise PlanMismatchError(f"no local segment holds {name}")
        array = initializers[ref.initializer]
        value = np.ascontiguousarray(array.T if ref.transpose else array, np.float32)
        if ref.offset:
            value = value - np.float32(ref.offset)
        state[local] = torch.from_numpy(value)
    missing = {n for n, _ in tail.named_parameters()} - set(state)
    if missing:
        raise PlanMismatchError(f"the weight map lacks {sorted(missing)[:5]}")
    tail.load_state_dict(state, strict=False, assign=True)
    tail.requires_grad_(False)
    targets = sorted({_tail_module(a, plan) for a in plan.adapters})
    lora = LoraConfig(
        r=plan.lora.rank,
        lora_alpha=plan.lora.alpha,  # type: ignore[arg-type]  # PEFT's annotation says int
        lora_dropout=0.0,
        target_modules=targets,
    )
    inject_adapter_in_model(lora, tail)
    return tail


def _tail_module(spec: AdapterSpec, plan: LoraPlan) -> str:
    local = _namer(plan)(f"{spec.module}.weight", plan.first_layer)
    if local is None:
        raise PlanMismatchError(f"adapter {spec.module} is not in the trainable layers")
    return local.removesuffix(".weight")


@dataclass(frozen=True)
class AdapterPair:
    """The ``lora_A`` and ``lora_B`` linear layers of one adapted module."""

    a: nn.Linear
    b: nn.Linear


def adapter_pairs(tail: nn.Module, plan: LoraPlan) -> list[AdapterPair]:
    """The adapters in plan order."""
    modules = dict(tail.named_modules())
    pairs = []
    for spec in plan.adapters:
        wrapped = modules.get(_tail_module(spec, plan))
        if wrapped is None or not hasattr(wrapped, "lora_A"):
            raise PlanMismatchError(f"{spec.module} got no adapter")
        pairs.append(AdapterPair(wrapped.lora_A[ADAPTER], wrapped.lora_B[ADAPTER]))
    return pairs


def set_adapters(pairs: Sequence[AdapterPair], arrays: Sequence[np.ndarray]) -> None:
    """Load wire-order arrays (A, B per adapter) into the adapters, checking shapes."""
    if len(arrays) != 2 * len(pairs):
        raise PlanMismatchError(f"{len(arrays)} arrays for {len(pairs)} adapters")
    with torch.no_grad():
        for k, pair in enumerate(pairs):
            for layer, array in ((pair.a, arrays[2 * k]), (pair.b, arrays[2 * k + 1])):
                if tuple(array.shape) != tuple(layer.weight.shape):
                    raise PlanMismatchError(
                        f"adapter shape {array.shape} != {tuple(layer.weight.shape)}"
                    )
                layer.weight.copy_(torch.from_numpy(np.asarray(array, dtype=np.float32)))


def get_adapters(pairs: Sequence[AdapterPair]) -> list[np.ndarray]:
    """The adapters' arrays in wire order."""
    out = []
    for pair in pairs:
        out += [pair.a.weight.detach().numpy().copy(), pair.b.weight.detach().numpy().copy()]
    return out
