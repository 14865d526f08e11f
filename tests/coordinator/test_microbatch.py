"""Large embeddings requests run as micro-batches of bounded padded size, from one version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from coordinator.deploy.limits import MICRO_BATCH_TOKENS
from coordinator.errors import NotServableError
from coordinator.serving.embeddings import HIDDEN, Embedder
from coordinator.serving.microbatch import micro_batches


def test_micro_batches_keep_order_and_fit_the_budget() -> None:
    lengths = [256] * 64 + [3, 5, 300, 7]
    parts = micro_batches(lengths, 2048)
    assert [i for part in parts for i in range(len(lengths))[part]] == list(range(len(lengths)))
    for part in parts:
        chunk = lengths[part]
        assert len(chunk) == 1 or max(chunk) * len(chunk) <= 2048
    assert micro_batches([10, 20], 2048) == [slice(0, 2)]  # small requests stay whole
    assert micro_batches([], 2048) == []


@dataclass
class _Version:
    plan_version: int


@dataclass
class _Record:
    tokenizer_dir: str


class _Store:
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def model(self, model_id: str) -> _Record:
        return _Record(self.directory)

    def active(self, model_id: str) -> _Active:
        return _Active()


@dataclass
class _Active:
    limits: None = None


class _Router:
    """Hidden states that depend on each token only, so padding cannot change a vector."""

    def __init__(self, versions: list[int]) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.versions = versions

    def infer(self, model_id: str, feeds: dict[str, Any]) -> tuple[_Version, dict[str, Any]]:
        ids = feeds["input_ids"]
        self.shapes.append(ids.shape)
        table = np.random.default_rng(0).normal(size=(40000, 8)).astype(np.float32)
        version = self.versions[min(len(self.shapes) - 1, len(self.versions) - 1)]
        return _Version(version), {HIDDEN: table[ids]}


def _tokenizer_dir() -> str:
    from partitioner.errors import GraphError
    from partitioner.models.packaged import minilm_dir

    try:
        return str(minilm_dir())
    except GraphError:
        pytest.skip("the MiniLM package is not installed")


def test_a_large_request_runs_in_bounded_micro_batches_with_the_same_answers() -> None:
    directory = _tokenizer_dir()
    texts = [("word " * (i % 300 + 1)).strip() for i in range(64)]
    router = _Router([1])
    version, vectors, tokens = Embedder(_Store(directory), router).embed("m", texts)  # type: ignore[arg-type]
    assert len(router.shapes) > 1
    assert all(b * s <= MICRO_BATCH_TOKENS or b == 1 for b, s in router.shapes)
    whole = _Router([1])
    embedder = Embedder(_Store(directory), whole)  # type: ignore[arg-type]
    one = [embedder.embed("m", [t])[1][0] for t in texts]  # each text alone
    np.testing.assert_allclose(vectors, np.stack(one), rtol=1e-5, atol=1e-6)
    assert version.plan_version == 1 and tokens > 0


def test_micro_batches_from_different_versions_are_never_mixed() -> None:
    directory = _tokenizer_dir()
    texts = [("word " * 250).strip()] * 32
    flipping = _Router([1, 2] * 100)  # a failover between every run
    with pytest.raises(NotServableError, match="changed version"):
        Embedder(_Store(directory), flipping).embed("m", texts)  # type: ignore[arg-type]
