"""A numpy forward (float64) of a GGUF decoder, from the same dequantized tensors, for tests.

Follows llama.cpp's semantics (``src/llama-model.cpp``, see :mod:`.header`), written
independently of the ONNX graph: RMS norms, RoPE in the file's layout (adjacent pairs for
``llama``, rotate-half otherwise), grouped-query attention with causal and sliding-window
masks, SwiGLU / GELU-tanh FFNs, Gemma 3's sandwich norms and embedding scale, Phi 3's fused
tensors, Qwen 2's biases, Qwen 3 / Gemma 3 q/k norms, final logit softcapping. Weights are
``gguf.quants.dequantize``'s values; activations stay float64 (llama.cpp quantizes them to
8 bits for its products, so agreement with it is a tolerance; ``forward``'s ``activations``
hook, e.g. :func:`q8_k`, applies such a rounding to every weight product's input).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from partitioner.models.gguf.archs import SWA_ROPE_BASE
from partitioner.models.gguf.header import Architecture, GgufModel
from partitioner.models.gguf.kernels import dequantize

Tensors = Callable[[str], np.ndarray]
"""A tensor's float64 values in its logical shape, by name."""
Activations = Callable[[np.ndarray], np.ndarray]
"""What a weight product's input becomes before the product (rows of the last axis)."""
Q8_K_BLOCK = 256


def _same(x: np.ndarray) -> np.ndarray:
    return x


def q8_k(x: np.ndarray) -> np.ndarray:
    """``x`` rounded as llama.cpp's CPU products round activations against K-quant weights
    (``quantize_row_q8_K_ref`` in ``ggml-quants.c``): per block of 256 values of the last axis,
    ``d = max / -128`` where ``max`` is the value of largest magnitude, codes
    ``min(127, round(x / d))``; returns ``codes * d``. A block holding one outlier keeps little
    of its other values."""
    blocks = np.asarray(x, np.float32).reshape(-1, Q8_K_BLOCK)
    big = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[:, None], -1)
    iscale = np.divide(-128.0, big, out=np.zeros_like(big), where=big != 0).astype(np.float32)
    codes = np.minimum(127.0, np.rint(iscale * blocks))
    d = np.divide(1.0, iscale, out=np.zeros_like(iscale), where=iscale != 0).astype(np.float32)
    rounded: np.ndarray = (codes * d).reshape(x.shape).astype(np.float64)
    return rounded


def dequantized(model: GgufModel, raw: Callable[[str], np.ndarray]) -> Tensors:
    """:data:`Tensors` over raw GGUF data (``gguf.quants.dequantize`` underneath)."""

    def get(name: str) -> np.ndarray:
        t = model.tensor(name)
        values: np.ndarray = dequantize(raw(name), t.type, t.shape).astype(np.float64)
        return values

    return get


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    out: np.ndarray = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    return out


def _rope(x: np.ndarray, pos: np.ndarray, inv: np.ndarray, layout: str) -> np.ndarray:
    """``x`` ``[T, heads, d]`` rotated by ``pos[t] * inv[i]``."""
    ang = pos[:, None, None] * inv[None, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    out = np.empty_like(x)
    half = x.shape[-1] // 2
    if layout == "pairs":
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    else:
        a, b = x[..., :half], x[..., half:]
        out[..., :half] = a * cos - b * sin
        out[..., half:] = a * sin + b * cos
    return out


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))
    return out


def _silu(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = x / (1.0 + np.exp(-x))
    return out


def _attention(
    m: GgufModel, w: Tensors, i: int, h: np.ndarray, pos: np.ndarray, act: Activations = _same
) -> np.ndarray:
    b = f"blk.{i}"
    n, d, hq, hk = h.shape[0], m.head_dim, m.heads, m.kv_heads
    h = act(h)
    if m.architecture == Architecture.PHI3:
        qkv = h @ w(f"{b}.attn_qkv.weight").T
        q, k, v = np.split(qkv, [hq * d, hq * d + hk * d], axis=-1)
    else:
        q, k, v = (h @ w(f"{b}.attn_{s}.weight").T for s in ("q", "k", "v"))
        if f"{b}.attn_q.bias" in m.tensors:
            q, k, v = (y + w(f"{b}.attn_{s}.bias") for y, s in zip((q, k, v), "qkv", strict=True))
    q, k, v = q.reshape(n, hq, d), k.reshape(n, hk, d), v.reshape(n, hk, d)
    if f"{b}.attn_q_norm.weight" in m.tensors:
        q = _rms(q, w(f"{b}.attn_q_norm.weight"), m.norm_eps)
        k = _rms(k, w(f"{b}.attn_k_norm.weight"), m.norm_eps)
    sliding = m.sliding(i)
    base, scale = (SWA_ROPE_BASE, 1.0) if sliding else (m.rope_base, m.rope_scale)
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d) / scale
    if "rope_freqs.weight" in m.tensors:
        inv = inv / w("rope_freqs.weight")
    q, k = _rope(q, pos, inv, m.rope_layout), _rope(k, pos, inv, m.rope_layout)
    allowed = pos[None, :] <= pos[:, None]
    if sliding and m.sliding_window is not None:
        allowed &= pos[:, None] - pos[None, :] < m.sliding_window
    groups = hq // hk
    out = np.empty((n, hq, d))
    for head in range(hq):
        kv = head // groups
        s = (q[:, head] @ k[:, kv].T) * m.attention_scale
        s = np.where(allowed, s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[:, head] = p @ v[:, kv]
    return act(out.reshape(n, hq * d)) @ w(f"{b}.attn_output.weight").T


def _ffn(m: GgufModel, w: Tensors, i: int, h: np.ndarray, act: Activations = _same) -> np.ndarray:
    b = f"blk.{i}"
    h = act(h)
    if m.architecture == Architecture.PHI3:
        gate, up = np.split(h @ w(f"{b}.ffn_up.weight").T, 2, axis=-1)
    else:
        gate, up = h @ w(f"{b}.ffn_gate.weight").T, h @ w(f"{b}.ffn_up.weight").T
    gated = _gelu_tanh(gate) if m.architecture == Architecture.GEMMA3 else _silu(gate)
    out: np.ndarray = act(gated * up) @ w(f"{b}.ffn_down.weight").T
    return out


def forward(
    m: GgufModel, w: Tensors, tokens: Sequence[int], activations: Activations = _same
) -> np.ndarray:
    """Logits ``[len(tokens), vocab]`` for ``tokens`` at positions ``0 .. len - 1``; every
    weight product's input goes through ``activations`` first (default: as it is)."""
    gemma = m.architecture == Architecture.GEMMA3
    eps = m.norm_eps
    x = w("token_embd.weight")[np.asarray(tokens)]
    if gemma:
        x = x * np.sqrt(m.hidden)
    pos = np.arange(len(tokens), dtype=np.float64)
    for i in range(m.layers):
        b = f"blk.{i}"
        a = _attention(m, w, i, _rms(x, w(f"{b}.attn_norm.weight"), eps), pos, activations)
        if gemma:
            a = _rms(a, w(f"{b}.post_attention_norm.weight"), eps)
        x = x + a
        f = _ffn(m, w, i, _rms(x, w(f"{b}.ffn_norm.weight"), eps), activations)
        if gemma:
            f = _rms(f, w(f"{b}.post_ffw_norm.weight"), eps)
        x = x + f
    logits = activations(_rms(x, w("output_norm.weight"), eps)) @ w(m.output_tensor).T
    if m.final_softcap is not None:
        logits = np.tanh(logits / m.final_softcap) * m.final_softcap
    result: np.ndarray = logits
    return result
