"""Tokenizer, chat template and incremental detokenization for text generation.

The tokenizer is a Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` library. The
chat template is the model package's Jinja template, rendered the way transformers renders it:
an :class:`jinja2.sandbox.ImmutableSandboxedEnvironment` (``trim_blocks``, ``lstrip_blocks``,
loop controls), the ``tojson`` filter, ``raise_exception`` and ``strftime_now`` globals, and
``messages``, ``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``)
as variables. The rendered text already carries its special tokens, so it is encoded without
adding more; a plain completion prompt gets the model's BOS id prepended.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from coordinator.errors import NotServableError, RequestError
from protocols.decoder import DecoderInfo

REPLACEMENT = "\ufffd"
"""What a decoder emits for bytes that are not (yet) complete UTF-8."""


class ChatTokenizer:
    """Encodes prompts, renders chat messages, decodes generated tokens."""

    def __init__(self, tokenizer: Any, info: DecoderInfo) -> None:
        """``tokenizer`` is a ``tokenizers.Tokenizer``; ``info`` names BOS, EOS and the template."""
        self._tokenizer = tokenizer
        self.bos_token_id = info.bos_token_id
        self.bos_token = self._token_text(info.bos_token_id)
        first_eos = info.eos_token_ids[0] if info.eos_token_ids else None
        self.eos_token = self._token_text(first_eos)
        self._template = _compile(info.chat_template) if info.chat_template else None

    @classmethod
    def from_file(cls, path: Path, info: DecoderInfo) -> ChatTokenizer:
        """Load ``tokenizer.json`` from ``path`` (a file, or a directory holding one)."""
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise NotServableError(f"no tokenizer at {file}")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust loader raises a bare Exception
            raise NotServableError(f"cannot load the tokenizer {file}: {exc}") from exc
        return cls(tokenizer, info)

    @property
    def has_chat_template(self) -> bool:
        """Whether chat messages can be rendered."""
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, adding no special tokens."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a plain completion prompt: BOS (if the model has one), then ``text``."""
        ids = self.encode(text)
        if self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped."""
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return text

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt text for ``messages``, ending with the assistant's turn.

        Raises :class:`RequestError` when the model has no chat template or the template refuses
        the conversation (``raise_exception``, e.g. roles that do not alternate).
        """
        import jinja2

        if self._template is None:
            raise RequestError("this model has no chat template; use /v1/completions")
        try:
            rendered: str = self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=True,
                tools=None,
                documents=None,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise RequestError(f"the chat template refused the messages: {exc}") from exc
        return rendered

    def incremental(self) -> IncrementalDecoder:
        """A fresh streaming detokenizer over this tokenizer."""
        return IncrementalDecoder(self)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        text = self._tokenizer.id_to_token(token_id)
        return text if isinstance(text, str) else ""


class IncrementalDecoder:
    """Turns generated token ids into text pieces that are always complete UTF-8.

    Each piece is the difference between decoding a short window of recent tokens with and
    without the newest ones, so decoders that depend on context (leading spaces, ``##``
    continuations, byte fallback) give the same text as decoding everything at once. A piece
    that would end in an incomplete character is held until the character is complete.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        """Start with no tokens."""
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; the new complete text (may be empty)."""
        self._ids.append(token_id)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        new_text = self._tokenizer.decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held (incomplete bytes become U+FFFD); call once at the end."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        new_text = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def _compile(source: str) -> Any:
    """Compile a chat template in transformers' sandbox."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise NotServableError(f"the model's chat template does not compile: {exc}") from exc


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> NoReturn:
    import jinja2

    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
