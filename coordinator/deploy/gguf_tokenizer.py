"""A GGUF file's tokenizer as a Hugging Face ``tokenizer.json``, built with ``tokenizers`` alone.

The file's metadata (``tokenizer.ggml.*``) carries the vocabulary, its merges or scores, the
token types and the special ids; ``tokenizers`` builds the same tokenizer transformers' GGUF
conversion builds, without loading transformers:

- ``gpt2`` (byte-level BPE: Llama 3, Qwen 2/2.5/3, SmolLM, Phi 3.5 mini's successors): the
  file's merges, the pre-tokenizer regex ``tokenizer.ggml.pre`` names (llama.cpp's
  ``llama-vocab.cpp``; GPT-2's own where the name is not known), byte-level decoding;
- ``llama`` (SentencePiece BPE: Llama 2, Mistral, Gemma 3, Phi 3): merges derived from the
  pieces' scores (a piece ``ab`` made of two pieces ``a`` and ``b`` is the merge ``a b``,
  ranked by the score of ``ab``), byte fallback for ``<0xNN>`` pieces, ``▁`` for spaces and a
  space prefix on the first piece unless ``tokenizer.ggml.add_space_prefix`` is false.

Control and user-defined tokens are added tokens (matched whole before the model runs), so a
chat template's ``<|im_start|>`` is one token. Anything else (``bert``, ``t5``, ``rwkv``
vocabularies) is refused with :class:`~coordinator.errors.UnsupportedModelError`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from coordinator.errors import UnsupportedModelError
from partitioner.models.gguf.reader import GgufFile, GgufFormatError

log = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
"""``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``)."""
GPT2_REGEX: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_REGEX: Final[Mapping[str, str]] = {
    "llama-bpe": LLAMA3_REGEX,
    "llama3": LLAMA3_REGEX,
    "smaug-bpe": LLAMA3_REGEX,
    "dbrx": LLAMA3_REGEX,
    "qwen2": QWEN2_REGEX,
    "deepseek-r1-qwen": QWEN2_REGEX,
    "qwen35": QWEN2_REGEX,
    "gpt-2": GPT2_REGEX,
    "default": GPT2_REGEX,
    "smollm": GPT2_REGEX,
}
"""``tokenizer.ggml.pre`` to its pre-tokenizer regex (llama.cpp ``llama-vocab.cpp``)."""
SPACE: Final = "\u2581"


@dataclass(frozen=True)
class GgufVocabulary:
    """The ``tokenizer.ggml.*`` metadata of a GGUF file."""

    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]
    add_bos: bool
    add_space_prefix: bool
    unknown_id: int | None


def read_vocabulary(path: Path) -> GgufVocabulary:
    """The tokenizer metadata of the GGUF file at ``path`` (its metadata only, no weight)."""
    try:
        header = GgufFile(path)
        meta = header.metadata
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise UnsupportedModelError(f"{path.name} carries no tokenizer", "tokenizer")
        tokens = header.array("tokenizer.ggml.tokens") or []
        types = header.array("tokenizer.ggml.token_type")
        scores = header.array("tokenizer.ggml.scores")
        merges = header.array("tokenizer.ggml.merges") or []
    except (OSError, GgufFormatError) as exc:
        raise UnsupportedModelError(f"cannot read {path.name}'s metadata: {exc}") from exc
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    return GgufVocabulary(
        model=str(model),
        pre=meta.get("tokenizer.ggml.pre"),
        tokens=list(tokens),
        types=[NORMAL] * len(tokens) if types is None else [int(t) for t in types],
        scores=[] if scores is None else [float(x) for x in scores],
        merges=list(merges),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        unknown_id=None if unknown is None else int(unknown),
    )


def build_tokenizer(vocab: GgufVocabulary) -> Any:
    """A ``tokenizers.Tokenizer`` for ``vocab``; UnsupportedModelError for a vocabulary kind
    other than ``gpt2`` and ``llama``."""
    if not vocab.tokens:
        raise UnsupportedModelError("the GGUF's tokenizer has no tokens", "tokenizer")
    if vocab.model == "gpt2":
        tokenizer = _byte_level_bpe(vocab)
    elif vocab.model == "llama":
        tokenizer = _sentencepiece_bpe(vocab)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {vocab.model!r} is not served (served: gpt2, llama)",
            f"tokenizer {vocab.model}",
        )
    _add_special(tokenizer, vocab)
    return tokenizer


def write_tokenizer(path: Path, out: Path) -> GgufVocabulary:
    """Write the GGUF file's tokenizer to ``out`` (a ``tokenizer.json``); its vocabulary."""
    vocab = read_vocabulary(path)
    build_tokenizer(vocab).save(str(out))
    return vocab


def _byte_level_bpe(vocab: GgufVocabulary) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    ids = {token: i for i, token in enumerate(vocab.tokens)}
    merges = [_pair(m) for m in vocab.merges]
    model = models.BPE(ids, merges, fuse_unk=False, ignore_merges=False)
    tokenizer = Tokenizer(model)
    regex = PRE_REGEX.get(vocab.pre or "default")
    if regex is None:
        log.warning("GGUF pre-tokenizer %r is not known here; using GPT-2's", vocab.pre)
        regex = GPT2_REGEX
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _sentencepiece_bpe(vocab: GgufVocabulary) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    ids = {token: i for i, token in enumerate(vocab.tokens)}
    merges = [_pair(m) for m in vocab.merges] or spm_merges(vocab.tokens, vocab.scores, vocab.types)
    unknown = vocab.unknown_id
    unk_token = (
        vocab.tokens[unknown] if unknown is not None and unknown < len(vocab.tokens) else None
    )
    model = models.BPE(ids, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    scheme = "first" if vocab.add_space_prefix else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def spm_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary: every split of a normal piece into two pieces
    of the vocabulary, the pieces with higher scores merged first (ties: the left part's id,
    then the right's). Sorted as arrays: Gemma 3's 515,000 merges are built in seconds."""
    ids = {token: i for i, token in enumerate(tokens)}
    score: list[float] = []
    lefts: list[int] = []
    rights: list[int] = []
    for i, piece in enumerate(tokens):
        if types[i] not in (NORMAL, USER_DEFINED) or len(piece) < 2:
            continue
        value = scores[i] if i < len(scores) else 0.0
        for cut in range(1, len(piece)):
            left, right = ids.get(piece[:cut]), ids.get(piece[cut:])
            if left is not None and right is not None:
                score.append(-value)
                lefts.append(left)
                rights.append(right)
    left_ids, right_ids = np.asarray(lefts), np.asarray(rights)
    order = np.lexsort((right_ids, left_ids, np.asarray(score)))
    return [(tokens[left_ids[k]], tokens[right_ids[k]]) for k in order.tolist()]


def _add_special(tokenizer: Any, vocab: GgufVocabulary) -> None:
    from tokenizers import AddedToken

    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(vocab.tokens, vocab.types, strict=False)
        if kind == CONTROL and token
    ]
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(vocab.tokens, vocab.types, strict=False)
        if kind == USER_DEFINED and token
    ]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)
