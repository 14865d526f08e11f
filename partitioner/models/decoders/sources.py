"""The decoder models ``fedshard export`` offers, loaded as torch models with their tokenizers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioner.errors import GraphError
from partitioner.models.decoders import gemma, qwen, tiny
from partitioner.models.decoders.progress import Steps
from partitioner.models.packaged import offline

DECODER_NAMES = (
    "gemma3-270m",
    "qwen2.5-coder-1.5b",
    "qwen2.5-coder-0.5b",
    "tiny-gemma3",
    "tiny-llama",
)


@dataclass(frozen=True)
class DecoderSource:
    """A loaded decoder: the torch model, its tokenizer and how to drive it."""

    name: str
    model: Any
    """A transformers ``*ForCausalLM`` in float32, eval mode."""
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    mask_dict: bool
    """The model takes ``{layer_type: 4D mask}`` (Gemma 3, Qwen 2) rather than one 4D mask
    (Llama)."""
    sliding_window: int | None
    """Window of the sliding-attention layers, ``None`` when every layer attends fully."""


def load_source(name: str, cache_dir: Path, steps: Steps) -> DecoderSource:
    """Load decoder ``name`` (one of :data:`DECODER_NAMES`); ``cache_dir`` holds converted
    checkpoints (used by the real models only)."""
    offline()
    if name == "gemma3-270m":
        model, tok = gemma.load(cache_dir, steps)
        return _gemma_source(name, model, tok, tuple(gemma.eos_token_ids(tok)))
    if name in qwen.MODELS:
        model, tok = qwen.load(cache_dir, steps, qwen.MODELS[name])
        return _gemma_source(name, model, tok, tuple(qwen.eos_token_ids(tok)))
    if name == "tiny-gemma3":
        model, tok = tiny.gemma3()
        return _gemma_source(name, model, tok, (int(tok.sep_token_id),))
    if name == "tiny-llama":
        model, tok = tiny.llama()
        return DecoderSource(name, model, tok, (int(tok.sep_token_id),), False, None)
    raise GraphError(f"unknown decoder {name!r}; known: {', '.join(DECODER_NAMES)}")


def _gemma_source(name: str, model: Any, tok: Any, eos: tuple[int, ...]) -> DecoderSource:
    """A model whose masks go by ``config.layer_types`` (Gemma 3, Qwen 2)."""
    config = model.config
    sliding = "sliding_attention" in config.layer_types
    window = int(config.sliding_window) if sliding else None
    return DecoderSource(name, model, tok, eos, True, window)
