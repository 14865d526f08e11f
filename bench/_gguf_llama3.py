"""Llama-3-shaped GGUF files for the scale benches (issue 40 item 8), without a real checkpoint.

:func:`q4_k_m_tensors` lists a Llama 3 model's tensors with llama.cpp's Q4_K_M type choice
(``llama_tensor_get_type``: Q4_K by default; ``attn_v`` and ``ffn_down`` Q6_K in the layers
``use_more_bits`` picks, the first and last eighth and every third between, about half;
``output`` Q6_K; norms F32). :func:`write_header_only` writes the header and tensor infos and
then extends the file to its full size without writing a byte of weights (a sparse file: the
planner reads tensor infos only). :func:`write_random` writes every tensor's data, one tensor at
a time (random K-quant blocks whose f16 ``d``/``dmin`` give ``std = 1/sqrt(n_in)``, as
:mod:`devtools.gguf_files` does, the spread taken from a sample of blocks so no tensor is
dequantized whole), so memory stays at one tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize

from devtools.gguf_files import CHAT_TEMPLATE, K_SCALE_OFFSETS

T = GGMLQuantizationType
ALIGNMENT = 32
SAMPLE_BLOCKS = 4096


@dataclass(frozen=True)
class Llama3Shape:
    """A Llama 3 model's shapes."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.hidden // self.heads


LLAMA3_8B = Llama3Shape("Llama-3-8B-shaped (random)", 32, 4096, 32, 8, 14336)
LLAMA3_70B = Llama3Shape("Llama-3-70B-shaped (header only)", 80, 8192, 64, 8, 28672)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: name, logical shape ``[n_out, n_in]`` (or ``[n]``), type."""

    name: str
    shape: tuple[int, ...]
    type: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data in the file."""
        per_block, size = GGML_QUANT_SIZES[self.type]
        count = int(np.prod(self.shape))
        return count // per_block * size

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """The shape GGUFWriter takes for raw data (uint8 rows for block types)."""
        if self.type == T.F32:
            return self.shape
        per_block, size = GGML_QUANT_SIZES[self.type]
        return (*self.shape[:-1], self.shape[-1] // per_block * size)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers Q4_K_M gives Q6_K ``attn_v``/``ffn_down``."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_tensors(s: Llama3Shape) -> list[TensorSpec]:
    """Every tensor of ``s`` in file order, typed as llama.cpp's Q4_K_M."""
    h, kv, f = s.hidden, s.kv_heads * s.head_dim, s.ffn
    out = [TensorSpec("token_embd.weight", (s.vocab, h), T.Q4_K)]
    for i in range(s.layers):
        big = T.Q6_K if use_more_bits(i, s.layers) else T.Q4_K
        p = f"blk.{i}."
        out += [
            TensorSpec(p + "attn_norm.weight", (h,), T.F32),
            TensorSpec(p + "attn_q.weight", (h, h), T.Q4_K),
            TensorSpec(p + "attn_k.weight", (kv, h), T.Q4_K),
            TensorSpec(p + "attn_v.weight", (kv, h), big),
            TensorSpec(p + "attn_output.weight", (h, h), T.Q4_K),
            TensorSpec(p + "ffn_norm.weight", (h,), T.F32),
            TensorSpec(p + "ffn_gate.weight", (f, h), T.Q4_K),
            TensorSpec(p + "ffn_up.weight", (f, h), T.Q4_K),
            TensorSpec(p + "ffn_down.weight", (h, f), big),
        ]
    out += [
        TensorSpec("output_norm.weight", (h,), T.F32),
        TensorSpec("output.weight", (s.vocab, h), T.Q6_K),
    ]
    return out


def _metadata(writer: GGUFWriter, s: Llama3Shape) -> None:
    writer.add_name(s.name)
    writer.add_block_count(s.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    tokens = [f"<{b:02x}>" for b in range(256)] + ["<s>", "</s>", "<|end|>", "a", "b", "ab"]
    tokens += [f"w{i}" for i in range(s.vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["a b"])  # llama.cpp refuses a BPE vocabulary without merges
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_chat_template(CHAT_TEMPLATE)


def _start(path: Path, s: Llama3Shape, tensors: list[TensorSpec]) -> GGUFWriter:
    writer = GGUFWriter(str(path), "llama")
    _metadata(writer, s)
    for t in tensors:
        dtype = np.float32 if t.type == T.F32 else np.uint8
        writer.add_tensor_info(t.name, t.byte_shape, np.dtype(dtype), t.nbytes, raw_dtype=t.type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return writer


def _padded(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def write_header_only(path: Path, s: Llama3Shape) -> list[TensorSpec]:
    """Header and tensor infos of ``s``; the data region is a hole of the right size."""
    tensors = q4_k_m_tensors(s)
    writer = _start(path, s, tensors)
    writer.close()
    size = _padded(path.stat().st_size) + sum(_padded(t.nbytes) for t in tensors)
    os.truncate(path, size)
    return tensors


def _k_blocks(t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    raw = rng.integers(0, 256, t.byte_shape, dtype=np.uint8)
    _, size = GGML_QUANT_SIZES[t.type]
    blocks = raw.reshape(-1, size)
    offsets = K_SCALE_OFFSETS[t.type]
    one = np.ones(SAMPLE_BLOCKS, np.float16).view(np.uint8).reshape(-1, 2)
    sample = blocks[:SAMPLE_BLOCKS].copy()
    for offset in offsets:
        sample[:, offset : offset + 2] = one[: len(sample)]
    spread = float(np.std(np.asarray(gguf_dequantize(sample, t.type), np.float64)))
    std = 1.0 / float(np.sqrt(t.shape[-1]))
    scale = np.frombuffer(np.float16(std / spread).tobytes(), np.uint8)
    for offset in offsets:
        blocks[:, offset : offset + 2] = scale
    return raw


def _data(t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    if t.type == T.F32:
        return (1.0 + 0.1 * rng.standard_normal(t.shape)).astype(np.float32)
    return _k_blocks(t, rng)


def write_random(path: Path, s: Llama3Shape, seed: int = 0) -> list[TensorSpec]:
    """A complete file of ``s`` with random weights, written one tensor at a time."""
    tensors = q4_k_m_tensors(s)
    writer = _start(path, s, tensors)
    for index, t in enumerate(tensors):
        writer.write_tensor_data(_data(t, np.random.default_rng([seed, index])))
    writer.close()
    return tensors
