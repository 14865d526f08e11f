"""Planned shapes are limits: the agent refuses larger frames with a typed wire code, its own
batching never stacks past them, and the coordinator cuts larger requests into runs that fit
(``/v1/infer`` along the batch axis, a decoder's long prompt as chunked prefill)."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from coordinator import errors as coord
from coordinator.deploy.limits import PREFILL_CHUNK, at_binding, planned_limits, planning_ladder
from coordinator.http.errors import CATALOGUE
from coordinator.serving.decoder import ChainDecoderBackend, prefill_chunk
from coordinator.serving.microbatch import join_runs, row_runs
from coordinator.transport.wire_errors import remote_error
from edge_agent.errors import ShapeLimitError
from edge_agent.net.wire_errors import error_header
from edge_agent.runtime.checks import InputSpec, check_planned, check_tensors
from edge_agent.serve.compute import Work, take_batch
from protocols.deploy import ShapeLimits
from protocols.errors import WireErrorCode
from protocols.frames import FrameHeader
from protocols.manifest import SessionLimits, TensorInfo

ENCODER = ShapeLimits(dims={"sequence": 256}, product_dims=["batch", "sequence"], product=512)
SPECS = (
    InputSpec("input_ids", "int64", ("batch", "sequence")),
    InputSpec("attention_mask", "int64", ("batch", "sequence")),
)


def _feeds(batch: int, sequence: int) -> dict[str, Any]:
    ids = np.ones((batch, sequence), np.int64)
    return {"input_ids": ids, "attention_mask": ids.copy()}


def test_limits_name_the_dimension_or_product_that_is_over() -> None:
    assert ENCODER.violation({"batch": 2, "sequence": 256}) is None
    assert ENCODER.violation({"batch": 64, "sequence": 8}) is None
    over = ENCODER.violation({"batch": 1, "sequence": 300})
    assert over is not None and "'sequence' is 300" in over
    product = ENCODER.violation({"batch": 3, "sequence": 256})
    assert product is not None and "batch x sequence is 768" in product
    assert ShapeLimits().violation({"batch": 10**6}) is None


def test_the_agent_refuses_a_frame_over_the_planned_shapes_with_a_typed_code() -> None:
    feeds, _ = check_tensors(SPECS, _feeds(2, 256), [])
    assert check_planned(ENCODER, SPECS, feeds) == {"batch": 2, "sequence": 256}
    assert check_planned(None, SPECS, _feeds(64, 256)) == {"batch": 64, "sequence": 256}
    with pytest.raises(ShapeLimitError, match="planned for 512") as caught:
        check_planned(ENCODER, SPECS, _feeds(4, 256))
    header = error_header(FrameHeader(request_id="r"), caught.value)
    assert header.error_code is WireErrorCode.SHAPE_LIMIT
    error = remote_error(header)
    assert isinstance(error, coord.ShapeLimitError)
    status = next(h for kind, h in CATALOGUE if isinstance(error, kind))
    assert (status.status, status.code) == (413, "shape_limit_exceeded")


def _work(deployed: Any, batch: int) -> Work:
    feeds = _feeds(batch, 128)
    dims = {"batch": batch, "sequence": 128}
    return Work(deployed, FrameHeader(request_id=f"r{batch}"), feeds, {}, 0.0, None, dims)


def test_the_agent_never_stacks_queued_requests_past_the_planned_shapes() -> None:
    manifest = SimpleNamespace(limits=ENCODER)
    deployed = SimpleNamespace(manifest=manifest, batchable=True, batch_symbol="batch")

    async def take(sizes: list[int]) -> list[list[int]]:
        queue: asyncio.Queue[Work] = asyncio.Queue()
        for size in sizes:
            queue.put_nowait(_work(deployed, size))
        held: deque[Work] = deque()
        batches = []
        while not queue.empty() or held:
            batches.append([w.dims["batch"] for w in await take_batch(queue, held)])
        return batches

    # 4 rows x 128 tokens = 512 fit one run; a fifth row would be 640
    assert asyncio.run(take([1, 1, 2, 1, 1])) == [[1, 1, 2], [1, 1]]
    manifest.limits = None
    assert asyncio.run(take([1, 1, 2, 1, 1])) == [[1, 1, 2, 1, 1]]


INPUTS = [TensorInfo(name=n, dtype="int64", shape=["batch", "sequence"]) for n in _feeds(1, 1)]
OUTPUTS = [TensorInfo(name="emb", dtype="float32", shape=["batch", 8])]


def test_the_coordinator_cuts_a_large_request_into_runs_that_fit() -> None:
    feeds = _feeds(10, 128)
    runs = row_runs(ENCODER, INPUTS, feeds)
    assert runs == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert row_runs(ENCODER, INPUTS, _feeds(4, 128)) == [slice(0, 4)]
    assert row_runs(None, INPUTS, feeds) == [slice(0, 10)]
    with pytest.raises(coord.ShapeLimitError, match="shorten"):
        row_runs(ENCODER, INPUTS, _feeds(2, 300))
    parts = [{"emb": np.full((r.stop - r.start, 8), i, np.float32)} for i, r in enumerate(runs)]
    joined = join_runs(parts, OUTPUTS)
    assert joined["emb"].shape == (10, 8) and joined["emb"][9, 0] == 2
    scalar = [TensorInfo(name="emb", dtype="float32", shape=[8])]
    with pytest.raises(coord.ShapeLimitError, match="no batch axis"):
        join_runs(parts, scalar)


def test_planned_limits_follow_the_planning_binding(tmp_path: Path) -> None:
    encoder = SimpleNamespace(sessions=None)
    limits = planned_limits(encoder, {"batch": 2, "sequence": 256})  # type: ignore[arg-type]
    assert limits == ENCODER
    assert planned_limits(encoder, {"batch": 8}) == ShapeLimits(dims={"batch": 8})  # type: ignore[arg-type]
    decoder: Any = SimpleNamespace(sessions=SessionLimits(max_sessions=2, max_context=300))
    limits = planned_limits(decoder, {})
    assert limits is not None and limits.dims == {"sequence": 64, "total_sequence": 300}
    assert planning_ladder(None) == [{}]
    (tmp_path / "tokenizer.json").write_text("{}")
    ladder = planning_ladder(str(tmp_path))  # 256 tokens kept without sentence_bert_config
    assert ladder[:3] == [
        {"batch": 2, "sequence": 256},
        {"batch": 1, "sequence": 256},
        {"batch": 1, "sequence": 128},
    ]
    assert ladder[-1] == {"batch": 1, "sequence": 32}
    (tmp_path / "decoder.json").write_text("{}")
    assert planning_ladder(str(tmp_path)) == [{}]  # the decode step, as the planner optimises
    limits = planned_limits(decoder, {"sequence": 1})
    assert limits is not None and limits.product == PREFILL_CHUNK


def test_warm_ups_run_at_the_planned_binding() -> None:
    samples = _feeds(3, 16)
    resized = at_binding(INPUTS, samples, {"batch": 2, "sequence": 256})
    assert resized is not None and resized["input_ids"].shape == (2, 256)
    assert at_binding(INPUTS, samples, {"batch": 3, "sequence": 16}) is None


class _Chain(ChainDecoderBackend):
    """The backend with the data plane replaced by a record of the steps it sends."""

    def __init__(self, limits: ShapeLimits | None) -> None:
        version = SimpleNamespace(plan_version=1, limits=limits)
        super().__init__(None, lambda deadline: (version, None), lambda v, e: None)  # type: ignore[arg-type,return-value]
        self.sent: list[tuple[int, int, bool]] = []

    async def _call(self, client: Any, tensors: Any, session: Any) -> Any:
        self.sent.append((session.position, tensors["input_ids"].shape[1], session.rewind))
        return {"top_logits": np.ones((1, 2), np.float32), "top_ids": np.zeros((1, 2), np.int64)}


def test_a_long_prompt_is_prefilled_in_planned_chunks() -> None:
    decoder: Any = SimpleNamespace(sessions=SessionLimits(max_sessions=1, max_context=512))
    limits = planned_limits(decoder, {})
    assert limits is not None and prefill_chunk(SimpleNamespace(limits=limits)) == 64  # type: ignore[arg-type]
    chain = _Chain(limits)
    asyncio.run(chain.step("s", 0, list(range(150))))
    assert chain.sent == [(0, 64, False), (64, 64, False), (128, 22, False)]
    asyncio.run(chain.step("s", 150, [7]))
    assert chain.sent[-1] == (150, 1, False)
    whole = _Chain(None)
    asyncio.run(whole.step("s", 0, list(range(150))))
    assert whole.sent == [(0, 150, False)]


def test_embeddings_longer_than_planned_are_refused_before_they_travel() -> None:
    from coordinator.serving.embeddings import _check_planned

    _check_planned([10, 64], ShapeLimits(dims={"sequence": 64}))
    _check_planned([500], None)
    with pytest.raises(coord.ShapeLimitError, match="input 1 has 65 tokens"):
        _check_planned([10, 65], ShapeLimits(dims={"sequence": 64}))
