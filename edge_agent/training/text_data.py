"""A device's text records (``fedshard agent --train-data DIR``), split into train and held out.

Formats (see :mod:`protocols.lora`): ``*.jsonl`` with ``{"messages": [{"role", "content"}]}``,
``{"text": ...}`` or ``{"anchor", "positive"}`` per line, and ``*.txt`` with one record per
non-empty line. A chat record becomes ``role: content`` lines. Which records are held out is
decided by each record's own hash, so a record is on the same side in every round and run.
Errors are typed (:mod:`edge_agent.training.errors`) and name the file and line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from edge_agent.training.errors import (
    EmptyDataError,
    MalformedRecordError,
    OneClassDataError,
    TrainDataError,
)
from protocols.lora import HELD_OUT_BYTE

MAX_RECORD_CHARS = 1 << 16


@dataclass(frozen=True)
class TextRecords:
    """Records for training and the held-out ones, with a digest of all of them."""

    train: tuple[str, ...]
    held_out: tuple[str, ...]
    sha256: str


@dataclass(frozen=True)
class PairRecords:
    """``(anchor, positive)`` pairs for training an encoder, and the held-out ones."""

    train: tuple[tuple[str, str], ...]
    held_out: tuple[tuple[str, str], ...]
    sha256: str


def is_held_out(text: str) -> bool:
    """Whether a record is held out (first byte of its SHA-256 below ``HELD_OUT_BYTE``)."""
    return hashlib.sha256(text.encode()).digest()[0] < HELD_OUT_BYTE


def _chat_text(messages: object, where: str) -> str:
    if not isinstance(messages, list) or not messages:
        raise MalformedRecordError(f"{where}: 'messages' must be a non-empty list")
    lines = []
    for message in messages:
        if not isinstance(message, dict):
            raise MalformedRecordError(f"{where}: a message must be an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str) or not content.strip():
            raise MalformedRecordError(f"{where}: a message needs string 'role' and 'content'")
        lines.append(f"{role}: {content.strip()}")
    return "\n".join(lines)


def _parse(line: str, where: str) -> str | tuple[str, str]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MalformedRecordError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise MalformedRecordError(f"{where}: a record must be a JSON object")
    if set(obj) == {"messages"}:
        return _chat_text(obj["messages"], where)
    if set(obj) == {"text"} and isinstance(obj["text"], str) and obj["text"].strip():
        return obj["text"].strip()
    anchor, positive = obj.get("anchor"), obj.get("positive")
    if (
        set(obj) == {"anchor", "positive"}
        and isinstance(anchor, str)
        and isinstance(positive, str)
        and anchor.strip()
        and positive.strip()
    ):
        return anchor.strip(), positive.strip()
    raise MalformedRecordError(
        f"{where}: expected 'messages', 'text' or 'anchor' and 'positive'; got {sorted(obj)}"
    )


def read_records(data_dir: Path) -> list[str | tuple[str, str]]:
    """Every record of ``data_dir`` (``*.jsonl`` and ``*.txt``, sorted by file name)."""
    if not data_dir.is_dir():
        raise TrainDataError(f"{data_dir}: no such training data directory")
    records: list[str | tuple[str, str]] = []
    for path in sorted(data_dir.iterdir()):
        if path.suffix not in (".jsonl", ".txt"):
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise TrainDataError(f"{path}: cannot read: {exc}") from exc
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path.name}:{number}"
            if len(line) > MAX_RECORD_CHARS:
                raise MalformedRecordError(f"{where}: record longer than {MAX_RECORD_CHARS} chars")
            records.append(_parse(line, where) if path.suffix == ".jsonl" else line.strip())
    if not records:
        raise EmptyDataError(f"{data_dir}: no records in *.jsonl or *.txt files")
    return records


def load_text(data_dir: Path) -> TextRecords:
    """Text records for a decoder: every record must be text (chat or plain), not a pair."""
    records = read_records(data_dir)
    texts = [r for r in records if isinstance(r, str)]
    if len(texts) != len(records):
        raise MalformedRecordError(f"{data_dir}: pair records cannot train a decoder")
    if len(set(texts)) < 2:
        raise OneClassDataError(f"{data_dir}: every record is the same text")
    train = tuple(t for t in texts if not is_held_out(t))
    held = tuple(t for t in texts if is_held_out(t))
    if not train:
        raise EmptyDataError(f"{data_dir}: every record is held out; add records")
    digest = hashlib.sha256("\n\x00".join(texts).encode()).hexdigest()
    return TextRecords(train, held, digest)


def load_pairs(data_dir: Path) -> PairRecords:
    """``{"anchor", "positive"}`` pairs for an encoder (in-batch negatives need two or more)."""
    records = read_records(data_dir)
    pairs = [r for r in records if isinstance(r, tuple)]
    if len(pairs) != len(records):
        raise MalformedRecordError(f"{data_dir}: text records cannot train an encoder")
    if len(set(pairs)) < 2:
        raise OneClassDataError(f"{data_dir}: every pair is the same")
    train = tuple(p for p in pairs if not is_held_out(p[0]))
    held = tuple(p for p in pairs if is_held_out(p[0]))
    if not train:
        raise EmptyDataError(f"{data_dir}: every pair is held out; add pairs")
    digest = hashlib.sha256(json.dumps(pairs).encode()).hexdigest()
    return PairRecords(train, held, digest)
