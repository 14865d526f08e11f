"""Small GGUF files with random weights, of every served architecture and tensor type.

:func:`write_gguf` writes a file with ``gguf.GGUFWriter`` tensor by tensor (infos first, then
each tensor's data made and written on its own, so a large file never exists in memory). Legacy
block types are quantized with ``gguf.quants.quantize``; the K-quants (which gguf-py cannot
quantize) are random blocks from ggml-common.h's layouts whose f16 ``d`` (and ``dmin``) are set
so the tensor's values have the wanted spread. Weights are scaled like an initialised model's
(``std = 1 / sqrt(n_in)``), norms near 1, so activations stay of order one through the layers.

The metadata carries what a loader needs: hyperparameters under ``{arch}.*``, a minimal
``gpt2`` tokenizer (one token per byte value and a few words), bos/eos and a chat template.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

T = GGMLQuantizationType
LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16)
K_SCALE_OFFSETS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
"""Byte offsets of each K-quant block's f16 ``d`` (and ``dmin``), from ggml-common.h."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

Mix = Mapping[str, GGMLQuantizationType]
"""Tensor type per role (``attn_q``, ``ffn_down``, ``token_embd``, ``output``, ...); roles not
named take ``mix["default"]``. Norms and biases are always F32."""
MIXES: dict[str, dict[str, GGMLQuantizationType]] = {
    "f32": {"default": T.F32},
    "q4_k_m": {
        "default": T.Q4_K,
        "attn_v": T.Q6_K,
        "ffn_down": T.Q6_K,
        "token_embd": T.Q8_0,
        "output": T.Q6_K,
    },
    "legacy": {
        "default": T.Q4_0,
        "attn_k": T.Q4_1,
        "attn_v": T.Q5_0,
        "attn_output": T.Q5_1,
        "ffn_down": T.Q8_0,
        "token_embd": T.Q4_0,
        "output": T.Q8_0,
    },
    "kquants": {
        "default": T.Q5_K,
        "attn_q": T.Q2_K,
        "attn_k": T.Q3_K,
        "ffn_up": T.Q4_K,
        "ffn_down": T.Q6_K,
        "token_embd": T.Q4_K,
        "output": T.Q5_K,
    },
    "floats": {"default": T.F16, "attn_v": T.BF16, "ffn_down": T.F32, "token_embd": T.BF16},
}
"""Named mixes; together they use every type the builder keeps exactly."""


@dataclass(frozen=True)
class Spec:
    """The shapes of a test model."""

    arch: str
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 512
    vocab: int = 300
    tied: bool = False
    sliding_window: int | None = None
    extra: dict[str, float] = field(default_factory=dict)
    """Float metadata added as is (``{arch}`` filled in), e.g. a final logit softcap."""
    rope_freqs: bool = False
    """Write Llama 3's ``rope_freqs.weight`` (per-dimension factors dividing the angles)."""


SPECS: dict[str, Spec] = {
    "llama": Spec("llama", layers=3),
    "qwen2": Spec("qwen2", tied=True),
    "qwen3": Spec("qwen3", head_dim=128),
    "gemma3": Spec("gemma3", layers=6, kv_heads=1, head_dim=128, tied=True, sliding_window=4),
    "phi3": Spec("phi3", kv_heads=4),
}
"""One small model per architecture (Gemma 3 has 6 layers so that one is global)."""


def layer_shapes(spec: Spec) -> dict[str, tuple[int, ...]]:
    """Per block: role to logical shape ``[n_out, n_in]`` (or ``[n]`` for norms, biases)."""
    h, q, kv, f = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.ffn
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (h,), "attn_output": (h, q)}
    if spec.arch == "phi3":
        shapes |= {"attn_qkv": (q + 2 * kv, h), "ffn_up": (2 * f, h)}
    else:
        shapes |= {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "ffn_gate": (f, h)}
        shapes["ffn_up"] = (f, h)
    shapes |= {"ffn_norm": (h,), "ffn_down": (h, f)}
    if spec.arch == "qwen2":
        shapes |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if spec.arch in ("qwen3", "gemma3"):
        shapes |= {"attn_q_norm": (spec.head_dim,), "attn_k_norm": (spec.head_dim,)}
    if spec.arch == "gemma3":
        shapes |= {"post_attention_norm": (h,), "post_ffw_norm": (h,)}
    return shapes


def tensor_list(spec: Spec) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, role, shape)`` of every tensor, in file order."""
    out: list[tuple[str, str, tuple[int, ...]]] = [
        ("token_embd.weight", "token_embd", (spec.vocab, spec.hidden))
    ]
    for i in range(spec.layers):
        for role, shape in layer_shapes(spec).items():
            name = f"blk.{i}.{role}" + ("" if role.endswith(".bias") else ".weight")
            out.append((name, role, shape))
    if spec.rope_freqs:
        out.append(("rope_freqs.weight", "rope_freqs", (spec.head_dim // 2,)))
    out.append(("output_norm.weight", "output_norm", (spec.hidden,)))
    if not spec.tied:
        out.append(("output.weight", "output", (spec.vocab, spec.hidden)))
    return out


def _type_for(role: str, shape: tuple[int, ...], mix: Mix) -> GGMLQuantizationType:
    if len(shape) == 1:
        return T.F32
    return mix.get(role, mix["default"])


def random_tensor(
    ggml_type: GGMLQuantizationType, shape: tuple[int, ...], std: float, rng: np.random.Generator
) -> np.ndarray:
    """Raw data as the writer takes it: float arrays for F32/F16, uint8 blocks otherwise."""
    rows, cols = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    if ggml_type in K_SCALE_OFFSETS:
        return _k_blocks(ggml_type, rows, cols, std, rng)
    if ggml_type not in (T.F32, T.F16, *LEGACY):  # other types: bytes of the right size only
        per_block, nbytes = GGML_QUANT_SIZES[ggml_type]
        return rng.integers(0, 256, (rows, cols // per_block * nbytes), dtype=np.uint8)
    w = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
    if ggml_type == T.F32:
        return w
    if ggml_type == T.F16:
        return w.astype(np.float16)
    return np.asarray(gguf_quantize(w, ggml_type))


def _k_blocks(
    ggml_type: GGMLQuantizationType, rows: int, cols: int, std: float, rng: np.random.Generator
) -> np.ndarray:
    per_block, nbytes = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows, cols // per_block * nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, nbytes)
    one = np.ones(blocks.shape[0], np.float16).view(np.uint8).reshape(-1, 2)
    for offset in K_SCALE_OFFSETS[ggml_type]:
        blocks[:, offset : offset + 2] = one
    sample = raw[: min(rows, 64)]  # the spread of a few rows: no tensor is dequantized whole
    spread = float(np.std(np.asarray(gguf_dequantize(sample, ggml_type), np.float64)))
    scale = np.full(blocks.shape[0], std / spread, np.float16).view(np.uint8).reshape(-1, 2)
    for offset in K_SCALE_OFFSETS[ggml_type]:
        blocks[:, offset : offset + 2] = scale
    return raw


def _std(role: str, shape: tuple[int, ...]) -> float:
    if role in ("token_embd", "output"):
        return 1.0 if role == "token_embd" else 1.0 / float(np.sqrt(shape[-1]))
    if role.endswith(".bias"):
        return 0.1
    return 1.0 / float(np.sqrt(shape[-1]))


def _values(
    role: str, shape: tuple[int, ...], t: GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    if role == "rope_freqs":
        return rng.uniform(1.0, 8.0, shape).astype(np.float32)
    if len(shape) == 1 and not role.endswith(".bias"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    values = random_tensor(t, shape, _std(role, shape), rng)
    return values.reshape(shape) if len(shape) == 1 else values


def write_gguf(
    path: Path,
    spec: Spec,
    mix: Mix | str = "f32",
    *,
    seed: int = 0,
    name: str | None = None,
    metadata: Callable[[GGUFWriter], None] | None = None,
) -> Path:
    """Write a random model of ``spec`` with tensor types ``mix`` to ``path``; tensor by tensor.

    ``metadata``: a hook adding or overriding keys (tests use it for refusals).
    """
    types = MIXES[mix] if isinstance(mix, str) else mix
    writer = GGUFWriter(str(path), spec.arch)
    _add_metadata(writer, spec, name or f"tiny-{spec.arch}")
    if metadata is not None:
        metadata(writer)
    tensors = tensor_list(spec)
    plan = []
    for index, (tname, role, shape) in enumerate(tensors):
        t = _type_for(role, shape, types)
        rng = np.random.default_rng([seed, index])
        sample = _values(role, shape, t, rng)
        writer.add_tensor_info(tname, sample.shape, sample.dtype, sample.nbytes, raw_dtype=t)
        plan.append((role, shape, t))
        del sample
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (role, shape, t) in enumerate(plan):
        writer.write_tensor_data(_values(role, shape, t, np.random.default_rng([seed, index])))
    writer.close()
    return path


def _add_metadata(writer: GGUFWriter, spec: Spec, name: str) -> None:
    writer.add_name(name)
    writer.add_block_count(spec.layers)
    writer.add_context_length(512)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    if spec.head_dim != spec.hidden // spec.heads:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0 if spec.arch != "gemma3" else 1_000_000.0)
    if spec.sliding_window is not None:
        writer.add_sliding_window(spec.sliding_window)
    for key, value in spec.extra.items():
        writer.add_float32(key.format(arch=spec.arch), value)
    tokens = [f"<{b:02x}>" for b in range(256)] + ["<s>", "</s>", "<|end|>"]
    tokens += [f"w{i}" for i in range(spec.vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_chat_template(CHAT_TEMPLATE)
