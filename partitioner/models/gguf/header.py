"""A GGUF file's header as a typed model: architecture, shapes, tensor infos, tokenizer facts.

:func:`read_header` reads metadata and tensor infos only (:mod:`.reader`; no weight is
touched). Everything the builder cannot serve exactly is refused here, before anything is
built, with :class:`UnsupportedModel` naming it (``reason``: ``architecture``, ``tensor_type``,
``rope_scaling``, ``tensor``, ``metadata``).

Architectures (llama.cpp's semantics, ``src/llama-model.cpp``):

========  ==========================================================================
llama     Llama 2/3.x, Mistral, SmolLM; RoPE on adjacent pairs (llama.cpp's converter
          permutes Q/K rows for it); optional ``rope_freqs.weight`` (Llama 3.x factors)
qwen2     q/k/v biases; NEOX (rotate-half) RoPE
qwen3     per-head q/k RMS norms; NEOX RoPE
gemma3    embedding times sqrt(hidden); pre/post norms around attention and FFN; q/k norms;
          GELU (tanh); every 6th layer global, the rest a sliding window; sliding layers
          use RoPE base ``rope.freq_base_swa`` (10000); norms are stored with the +1 already
          added by llama.cpp's converter, so they are plain ``w * x`` here
phi3      fused ``attn_qkv`` and ``ffn_up`` (gate then up); NEOX RoPE; no sliding window
          (llama.cpp disables Phi 3's)
========  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

from partitioner.errors import GraphError
from partitioner.models.gguf.kernels import MATMUL_BITS
from partitioner.models.gguf.kernels_codes import FLOAT_TYPES
from partitioner.models.gguf.reader import GgufFile
from protocols.base import FrozenModel

__all__ = [
    "Architecture",
    "GgufModel",
    "RopeLayout",
    "TensorEntry",
    "UnsupportedModel",
    "read_header",
]


class Architecture(StrEnum):
    """The ``general.architecture`` values served."""

    LLAMA = "llama"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    GEMMA3 = "gemma3"
    PHI3 = "phi3"


RopeLayout = Literal["pairs", "neox"]
"""``pairs``: rotate adjacent (2i, 2i+1) pairs (llama.cpp's ``LLAMA_ROPE_TYPE_NORM``);
``neox``: rotate dims i and i + d/2 (``LLAMA_ROPE_TYPE_NEOX``)."""
ROPE_LAYOUT: dict[Architecture, RopeLayout] = {
    Architecture.LLAMA: "pairs",
    Architecture.QWEN2: "neox",
    Architecture.QWEN3: "neox",
    Architecture.GEMMA3: "neox",
    Architecture.PHI3: "neox",
}
GEMMA3_SWA_PERIOD = 6
"""Gemma 3: layer ``i`` is global when ``i % 6 == 5`` (llama.cpp ``set_swa_pattern(6)``)."""
Reason = Literal["architecture", "tensor_type", "rope_scaling", "tensor", "metadata"]


class UnsupportedModel(GraphError):
    """A GGUF file the builder cannot serve exactly; ``reason`` says which kind of thing and
    ``detail`` names it (the architecture, tensor type, rope scaling mode, tensor or key)."""

    def __init__(self, reason: Reason, detail: str, message: str) -> None:
        super().__init__(message)
        self.reason: Reason = reason
        self.detail = detail


class TensorEntry(FrozenModel):
    """One tensor's info: logical shape outermost first (``[n_out, n_in]`` for a weight)."""

    name: str = Field(min_length=1, max_length=256)
    ggml_type: str = Field(min_length=1, max_length=32)
    """``GGMLQuantizationType`` name (``Q4_K``, ``F32``)."""
    shape: tuple[PositiveInt, ...]
    n_bytes: NonNegativeInt
    offset: NonNegativeInt
    """Absolute byte offset of the data in the file."""

    @property
    def type(self) -> GGMLQuantizationType:
        """The tensor type as gguf's enum."""
        return GGMLQuantizationType[self.ggml_type]

    @property
    def elements(self) -> int:
        """Number of values."""
        return int(np.prod(self.shape, dtype=np.int64))


class TypeUse(FrozenModel):
    """How many tensors of one type a file holds, and their bytes."""

    count: NonNegativeInt
    n_bytes: NonNegativeInt


class GgufModel(FrozenModel):
    """What the builder, the planner and the console need of a GGUF file (header only)."""

    path: str
    architecture: Architecture
    name: str
    parameters: NonNegativeInt
    quantization: dict[str, TypeUse]
    """Per tensor type name: count and bytes."""
    layers: PositiveInt
    hidden: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt
    ffn: PositiveInt
    vocab: PositiveInt
    rope_base: PositiveFloat
    rope_base_swa: PositiveFloat | None = None
    rope_layout: RopeLayout
    rope_scale: PositiveFloat = 1.0
    """Linear RoPE scaling factor (positions divided by it); 1 when none."""
    norm_eps: PositiveFloat
    context_length: PositiveInt
    sliding_window: PositiveInt | None = None
    attention_scale: PositiveFloat
    final_softcap: PositiveFloat | None = None
    tied_embeddings: bool
    tensors: dict[str, TensorEntry]
    bos_token_id: NonNegativeInt | None = None
    eos_token_ids: tuple[NonNegativeInt, ...] = ()
    chat_template: str | None = None

    def sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends within :attr:`sliding_window` only."""
        if self.sliding_window is None:
            return False
        return layer % GEMMA3_SWA_PERIOD != GEMMA3_SWA_PERIOD - 1

    def tensor(self, name: str) -> TensorEntry:
        """The info of ``name``; :class:`UnsupportedModel` (``tensor``) when absent."""
        entry = self.tensors.get(name)
        if entry is None:
            raise UnsupportedModel("tensor", name, f"GGUF file has no tensor {name!r}")
        return entry

    def layer_tensors(self, layer: int) -> list[TensorEntry]:
        """The tensors of block ``layer`` (``blk.{layer}.*``)."""
        prefix = f"blk.{layer}."
        return [t for n, t in self.tensors.items() if n.startswith(prefix)]

    @property
    def output_tensor(self) -> str:
        """The output head's tensor (the embedding when tied)."""
        return "token_embd.weight" if self.tied_embeddings else "output.weight"


def read_header(path: Path | str) -> GgufModel:
    """The header of the GGUF file at ``path`` (weights are never read).

    Raises :class:`UnsupportedModel` for an architecture, tensor type, rope scaling mode or
    missing tensor the builder does not serve.
    """
    return header_of(GgufFile(path))


def header_of(file: GgufFile) -> GgufModel:
    """:func:`read_header` on an open file."""
    meta = dict(file.metadata)
    arch_name = str(meta.get("general.architecture", ""))
    try:
        arch = Architecture(arch_name)
    except ValueError:
        raise UnsupportedModel(
            "architecture",
            arch_name,
            f"GGUF architecture {arch_name!r} is not served "
            f"(served: {', '.join(a.value for a in Architecture)})",
        ) from None
    tensors = {
        t.name: TensorEntry(
            name=t.name,
            ggml_type=t.ggml_type.name,
            shape=tuple(reversed(t.dims)),
            n_bytes=t.n_bytes,
            offset=t.offset,
        )
        for t in file.tensors.values()
    }
    _check_types(tensors)
    hp = _hyperparameters(arch, meta, tensors)
    _check_tensors(arch, hp["layers"], tensors)
    quant: dict[str, dict[str, int]] = {}
    for t in tensors.values():
        use = quant.setdefault(t.ggml_type, {"count": 0, "n_bytes": 0})
        use["count"] += 1
        use["n_bytes"] += t.n_bytes
    eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return GgufModel(
        path=str(file.path),
        architecture=arch,
        name=str(meta.get("general.name") or file.path.stem),
        parameters=sum(t.elements for t in tensors.values()),
        quantization={k: TypeUse(count=v["count"], n_bytes=v["n_bytes"]) for k, v in quant.items()},
        tensors=tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        chat_template=meta.get("tokenizer.chat_template"),
        **hp,
    )


def _check_types(tensors: Mapping[str, TensorEntry]) -> None:
    for t in tensors.values():
        kind = t.type
        if kind in FLOAT_TYPES or kind in MATMUL_BITS:
            continue
        known = "gguf-py dequantizes it; " if kind in GGML_QUANT_SIZES else ""
        raise UnsupportedModel(
            "tensor_type",
            kind.name,
            f"tensor {t.name!r} has type {kind.name}, which has no exact ONNX Runtime mapping "
            f"({known}re-quantizing with --weights int4|int8 is not built yet)",
        )


def _need(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedModel("metadata", key, f"GGUF file lacks metadata key {key!r}")
    return meta[key]


def _hyperparameters(
    arch: Architecture, meta: Mapping[str, Any], tensors: Mapping[str, TensorEntry]
) -> dict[str, Any]:
    a = arch.value
    hidden = int(_need(meta, f"{a}.embedding_length"))
    heads = int(_need(meta, f"{a}.attention.head_count"))
    kv_heads = int(meta.get(f"{a}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{a}.attention.key_length", hidden // heads))
    layers = int(_need(meta, f"{a}.block_count"))
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise UnsupportedModel("tensor", "token_embd.weight", "GGUF file has no token_embd.weight")
    scaling = str(meta.get(f"{a}.rope.scaling.type", "none"))
    factor = float(meta.get(f"{a}.rope.scaling.factor", 1.0) or 1.0)
    if scaling not in ("none", "linear") and not (scaling == "yarn" and factor == 1.0):
        raise UnsupportedModel(
            "rope_scaling", scaling, f"RoPE scaling {scaling!r} is not served (none or linear)"
        )
    if arch == Architecture.PHI3 and "rope_factors_long.weight" in tensors:
        raise UnsupportedModel(
            "rope_scaling", "longrope", "Phi 3 LongRoPE (rope_factors_long) is not served"
        )
    gemma = arch == Architecture.GEMMA3
    window = meta.get(f"{a}.attention.sliding_window") if gemma else None
    scale = head_dim**-0.5
    if gemma and layers == 62:  # llama.cpp: Gemma 3 27B scales by hidden / heads
        scale = (hidden / heads) ** -0.5
    softcap = meta.get(f"{a}.final_logit_softcapping")
    return {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "ffn": int(_need(meta, f"{a}.feed_forward_length")),
        "vocab": int(embd.shape[0]),
        "rope_base": float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "rope_base_swa": float(meta.get(f"{a}.rope.freq_base_swa", 10000.0)) if gemma else None,
        "rope_layout": ROPE_LAYOUT[arch],
        "rope_scale": factor if scaling == "linear" else 1.0,
        "norm_eps": float(_need(meta, f"{a}.attention.layer_norm_rms_epsilon")),
        "context_length": int(meta.get(f"{a}.context_length", 2048)),
        "sliding_window": int(window) if window else None,
        "attention_scale": scale,
        "final_softcap": float(softcap) if softcap else None,
        "tied_embeddings": "output.weight" not in tensors,
    }


LAYER_TENSORS: dict[Architecture, tuple[str, ...]] = {
    Architecture.LLAMA: (
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ),
    Architecture.QWEN2: (
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ),
    Architecture.QWEN3: (
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_q_norm",
        "attn_k_norm",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ),
    Architecture.GEMMA3: (
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_q_norm",
        "attn_k_norm",
        "attn_output",
        "post_attention_norm",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
        "post_ffw_norm",
    ),
    Architecture.PHI3: ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"),
}
"""Weights every block must have (``blk.{i}.{name}.weight``)."""


def _check_tensors(arch: Architecture, layers: int, tensors: Mapping[str, TensorEntry]) -> None:
    needed = ["token_embd.weight", "output_norm.weight"]
    needed += [f"blk.{i}.{n}.weight" for i in range(layers) for n in LAYER_TENSORS[arch]]
    for name in needed:
        if name not in tensors:
            raise UnsupportedModel("tensor", name, f"GGUF file has no tensor {name!r}")
