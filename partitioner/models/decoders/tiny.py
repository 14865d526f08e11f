"""Tiny random decoders for tests: Llama and Gemma 3 shapes, exported in seconds.

Both use the all-MiniLM-L6-v2 package's WordPiece tokenizer (it loads instantly and is
installed anyway) and a fixed seed, so the same name always gives the same weights.
``tiny-gemma3`` has an 8-token sliding window on most layers, so a 32-token generation
depends on the window being honoured.
"""

from __future__ import annotations

from typing import Any

from partitioner.models.packaged import minilm_dir

SEED = 1234
"""torch seed for the random weights."""

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}[CLS] {{ message['role'] }}: {{ message['content'] }} [SEP] "
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
"""A plain chat template for the WordPiece tokenizer (no special chat tokens exist there)."""

TINY_SLIDING_WINDOW = 8

_INIT_RANGE = 0.2
"""Wider than transformers' 0.02 so that next-token logits are well separated (no near-ties
that float rounding could flip between two runtimes)."""


def tokenizer() -> Any:
    """The MiniLM WordPiece tokenizer with :data:`TINY_CHAT_TEMPLATE`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def _common(tok: Any) -> dict[str, Any]:
    return {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "bos_token_id": tok.cls_token_id,
        "eos_token_id": tok.sep_token_id,
        "pad_token_id": tok.pad_token_id,
        "initializer_range": _INIT_RANGE,
        "tie_word_embeddings": False,
    }


def _build(model_class: Any, config: Any) -> Any:
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = model_class(config)
    return model.eval()


def llama() -> tuple[Any, Any]:
    """``(model, tokenizer)``: a 4-layer LlamaForCausalLM with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    config = LlamaConfig(num_hidden_layers=4, **_common(tok))
    return _build(LlamaForCausalLM, config), tok


def gemma3() -> tuple[Any, Any]:
    """``(model, tokenizer)``: a 6-layer Gemma3ForCausalLM, 8-token sliding window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = tokenizer()
    sliding, full = "sliding_attention", "full_attention"
    config = Gemma3TextConfig(
        num_hidden_layers=6,
        layer_types=[sliding, sliding, full, sliding, sliding, full],
        sliding_window=TINY_SLIDING_WINDOW,
        query_pre_attn_scalar=16,
        **_common(tok),
    )
    return _build(Gemma3ForCausalLM, config), tok
