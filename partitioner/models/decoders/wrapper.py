"""The torch module that is exported: explicit KV tensors in, top-k and grown KV out.

Masks and rotary positions come from ``attention_mask`` and ``position_ids`` only (see
:mod:`protocols.decoder`): the module builds the 4D additive masks itself (causal, and for
sliding-window layers causal within the window), passes ``position_ids`` explicitly, and feeds
the past through a cache whose layers never truncate, so every layer's present is
``concat(past, new)`` along axis 2. torch is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from protocols.decoder import TRAILING_POSITIONS

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
ATTENTION_NAME = "fedshard_grouped"
"""The attention implementation registered with transformers for export (see
:func:`grouped_attention`)."""


def build_masks(
    attention_mask: Any, position_ids: Any, sliding_window: int | None, dtype: Any
) -> dict[str, Any]:
    """Additive masks ``[batch, 1, q, total]`` keyed by layer type.

    Key slot ``j`` holds the token at position ``j`` (batch 1, no padding), so query at
    position ``p`` may see slot ``j`` when ``j <= p`` and ``attention_mask[j] == 1``; a
    sliding-window layer also needs ``p - j < sliding_window`` (as transformers does).
    """
    import torch

    total = attention_mask.shape[1]
    slots = torch.arange(total, dtype=position_ids.dtype, device=position_ids.device)
    query = position_ids[:, :, None]
    allowed = (slots[None, None, :] <= query) & attention_mask[:, None, :].bool()
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    zero = torch.tensor(0.0, dtype=dtype)
    masks = {FULL_ATTENTION: torch.where(allowed, zero, blocked)[:, None, :, :]}
    if sliding_window is not None:
        in_window = slots[None, None, :] > query - sliding_window
        masks[SLIDING_ATTENTION] = torch.where(allowed & in_window, zero, blocked)[:, None, :, :]
    return masks


def grouped_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Eager attention with grouped query heads, without reshaping keys or values.

    transformers' eager attention repeats every key/value head with ``expand`` + ``reshape``,
    which makes the exported graph read each layer's key length from its ``past`` input. Here
    the query heads are grouped instead (``[b, kv_heads, groups, q, d]``) and keys and values
    are only unsqueezed, so no shape of a key/value tensor is ever needed as a value.
    """
    import torch

    batch, heads, length, dim = query.shape
    groups = module.num_key_value_groups
    grouped = query.reshape(batch, heads // groups, groups, length, dim)
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.matmul(grouped, key.unsqueeze(2).transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask.unsqueeze(2)
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value.unsqueeze(2)).reshape(batch, heads, length, dim)
    return out.transpose(1, 2).contiguous(), probs


def use_grouped_attention(model: Any) -> str:
    """Switch ``model`` to :func:`grouped_attention`; returns the implementation it had."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, grouped_attention)
    previous = str(model.config._attn_implementation)
    model.set_attn_implementation(ATTENTION_NAME)
    return previous


def filled_cache(past: Sequence[Any]) -> Any:
    """A ``DynamicCache`` of plain (never truncating) layers holding ``past`` = k0, v0, k1, ..."""
    from transformers import cache_utils

    plain_layer: Any = cache_utils.DynamicLayer
    layers: list[Any] = []
    for keys, values in zip(past[0::2], past[1::2], strict=True):
        layer = plain_layer()
        layer.keys, layer.values = keys, values
        layer.device = keys.device
        layer.is_initialized = True
        layers.append(layer)
    cache: Any = cache_utils.DynamicCache()
    cache.layers = layers
    return cache


def decoder_module(
    model: Any,
    *,
    top_k: int,
    sliding_window: int | None,
    mask_dict: bool,
    trailing: int = TRAILING_POSITIONS,
) -> Any:
    """Wrap a ``*ForCausalLM`` as ``(input_ids, attention_mask, position_ids, *past) ->
    (top_logits, top_ids, trailing_top_logits, trailing_top_ids, *present)``.

    ``mask_dict``: pass the masks as ``{layer_type: mask}`` (Gemma 3) instead of one 4D
    tensor (Llama). ``trailing``: the output head runs on the step's last ``min(q, trailing)``
    positions and returns each one's top-k (``[batch, min(q, trailing), top_k]``), so a step
    that feeds drafted tokens verifies them all in one pass; the last one is also returned as
    ``top_logits``/``top_ids`` for callers that only want the next token.
    """
    import torch

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(
            self, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any
        ) -> tuple[Any, ...]:
            cache = filled_cache(past)
            dtype = self.model.get_input_embeddings().weight.dtype
            masks = build_masks(attention_mask, position_ids, sliding_window, dtype)
            out = self.model(
                input_ids=input_ids,
                attention_mask=masks if mask_dict else masks[FULL_ATTENTION],
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=trailing,
            )
            top_logits, top_ids = torch.topk(out.logits[:, -1, :], top_k, dim=-1)
            every_logits, every_ids = torch.topk(out.logits, top_k, dim=-1)
            present = [t for layer in cache.layers for t in (layer.keys, layer.values)]
            return (top_logits, top_ids, every_logits, every_ids, *present)

    return Decoder().eval()
