"""Tiny GGUF files with a real byte-level BPE tokenizer, and their numpy greedy reference.

``devtools.gguf_files`` writes the random weights; the hook here swaps its placeholder
vocabulary for a GPT-2-style one (a token per byte in byte-level form, merges of common letter
pairs, control tokens), so any prompt encodes and a served model's text can be compared.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from devtools.gguf_files import SPECS, Spec, write_gguf
from partitioner.models.gguf.builder import GgufSource
from partitioner.models.gguf.reference import dequantized, forward

SPECIALS = ["<s>", "</s>", "<|end|>"]
BOS, EOS = 256, 257
TEXT = "the devices of a local network run one model together when no single device can hold it"


def byte_level() -> list[str]:
    """GPT-2's byte-to-unicode table: the token text of each byte value, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a ``size``-token byte-level BPE vocabulary."""
    tokens = [*byte_level(), *SPECIALS]
    types = [1] * 256 + [3] * len(SPECIALS)
    merges: list[str] = []
    words = TEXT.replace(" ", " \u0120").split(" ")
    for word in words:
        for a, b in itertools.pairwise(word):
            if len(tokens) >= size:
                break
            if a + b not in tokens:
                tokens.append(a + b)
                types.append(1)
                merges.append(f"{a} {b}")
    while len(tokens) < size:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(5)
    return tokens, types, merges


def _tokenizer_hook(spec: Spec, add_bos: bool) -> object:
    def hook(writer: GGUFWriter) -> None:
        for kv in writer.kv_data:
            for key in [k for k in kv if k.startswith("tokenizer.ggml.")]:
                del kv[key]
        tokens, types, merges = vocabulary(spec.vocab)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(BOS)
        writer.add_eos_token_id(EOS)
        writer.add_add_bos_token(add_bos)

    return hook


def write_tiny(
    path: Path, arch: str = "llama", mix: str = "f32", *, add_bos: bool = True, seed: int = 0
) -> Path:
    """A small random GGUF of ``arch`` (``devtools.gguf_files.SPECS``) with the byte-level
    tokenizer."""
    spec = SPECS[arch]
    hook = _tokenizer_hook(spec, add_bos)
    return write_gguf(path, spec, mix, seed=seed, metadata=hook)  # type: ignore[arg-type]


def reference_greedy(path: Path, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy tokens after ``prompt`` from the numpy reference (float64, full recompute per
    step), stopping after the end-of-text token (not included)."""
    source = GgufSource(path)
    weights = dequantized(source.model, source.raw)
    ids = list(prompt)
    new: list[int] = []
    for _ in range(max_tokens):
        token = int(np.argmax(forward(source.model, weights, ids)[-1]))
        if token in source.model.eos_token_ids:
            break
        new.append(token)
        ids.append(token)
    return new
