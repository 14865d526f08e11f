"""Planned shapes: what a deployment's memory is planned for becomes a limit on every request.

Each stage's activation workspace, and the ONNX Runtime arena that keeps its peak, grows with
the batch and sequence sizes it runs. So a deployment is planned (costed by the partitioner) at
its *serving* shapes, the signed manifest of every stage carries them as
:class:`~protocols.deploy.ShapeLimits` (each agent refuses a larger frame with the wire code
``shape_limit``), and the coordinator cuts larger requests into runs that fit:

- a model with ``batch`` and ``sequence`` inputs (a text encoder): the sequence is limited to
  the longest input its tokenizer keeps (or the planned sequence), and one run carries at most
  :data:`~coordinator.serving.microbatch.MICRO_BATCH_TOKENS` padded tokens (batch x sequence);
  it is planned at ``batch = tokens / sequence`` x ``sequence``, the largest attention
  workspace within those limits, or at half the tokens and so on (:func:`planning_ladder`),
  whichever of those that keep the whole sequence has the best plan per token on the devices
  (:func:`rungs_by_quality`), and only when none fits at a shorter sequence: the plan decides
  the shapes the devices can afford;
- a decoder: a step carries at most :data:`PREFILL_CHUNK` tokens (long prompts are prefilled in
  chunks, see :mod:`coordinator.serving.decoder`), and the context at most the planned one. Its
  plan (compute and memory) stays at the decode step, the phase the planner optimises, so a
  prefill chunk's workspace is bounded by this limit but not reserved by the plan;
- any other model: every symbolic dimension at most its size in the samples it was planned on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from protocols.decoder import DECODER_FILE
from protocols.deploy import ShapeLimits
from protocols.manifest import Manifest, TensorInfo

BATCH = "batch"
SEQUENCE = "sequence"
TOTAL_SEQUENCE = "total_sequence"
MICRO_BATCH_TOKENS = 512
"""Most padded tokens (inputs x longest) one run through the stages may carry. Three MiniLM
agents after 64 inputs of 256 tokens: +2 to +29 MB resident at 512, 305-345 MB at 2,048, and
1.4-1.5 GB as one batch."""
DEFAULT_MAX_TOKENS = 256
"""Longest text input of a tokenizer without ``sentence_bert_config.json``."""
MIN_TOKENS = 32
"""The smallest encoder run the deployer plans for before it gives up on a device set."""
RUNG_TOLERANCE = 0.05
"""Plans per token within this share of each other count as alike (a few per cent are within
the cost model's error): a smaller rung is planned at only when it is better by more."""
PREFILL_CHUNK = 64
"""Most new tokens one decoder step carries: longer prompts are prefilled in chunks."""


def planning_ladder(
    tokenizer_dir: str | None, tokens: int = MICRO_BATCH_TOKENS
) -> list[dict[str, int]]:
    """The bindings to plan a model at, largest first (the deployer takes the first that fits).

    A text encoder: ``tokens // sequence`` x ``sequence`` with the sequence the longest input
    its tokenizer keeps (at most ``tokens``), then halved tokens and sequences down to
    :data:`MIN_TOKENS`. A decoder (``decoder.json`` next to its tokenizer) and any other model:
    its samples' shapes (one empty binding).
    """
    if tokenizer_dir is None:
        return [{}]
    directory = Path(tokenizer_dir)
    if (directory / DECODER_FILE).is_file():
        return [{}]  # planned at the decode step; see the module docstring
    if not (directory / "tokenizer.json").is_file():
        return [{}]
    longest = tokenizer_max_tokens(directory)
    ladder = []
    for budget in _halvings(tokens, MIN_TOKENS):
        sequence = min(longest, budget)
        ladder.append({BATCH: max(1, budget // sequence), SEQUENCE: sequence})
    return ladder


def keeping_sequence(ladder: Sequence[dict[str, int]]) -> list[dict[str, int]]:
    """The rungs of ``ladder`` that keep its first rung's sequence (the longest input the
    tokenizer keeps): planned at one of them, the deployment accepts every input whole."""
    return [dims for dims in ladder if dims.get(SEQUENCE) == ladder[0].get(SEQUENCE)]


def rungs_by_quality(
    ladder: Sequence[dict[str, int]], plan_times: Sequence[tuple[float, float] | None]
) -> list[dict[str, int]]:
    """The order to plan ``ladder``'s rungs in.

    ``plan_times`` has one entry for each rung that keeps the sequence
    (:func:`keeping_sequence`): its plan's seconds under the objective and under the other one
    (bottleneck and latency for the throughput objective, the other way round for latency),
    or None where the devices cannot hold it. First comes the rung with the best objective
    per token of those, where rungs within :data:`RUNG_TOLERANCE` of it are told apart by the
    other measure per token (a link-bound plan's throughput is the same at any rung, its
    latency is not), and the larger one wins what is still within the tolerance; then the
    other feasible ones, largest first; then the rungs with shorter sequences, largest first.

    The largest rung is not always the best plan: its activations may fit only on devices
    behind a slow link, where half the tokens per run fit on faster ones (MiniLM in the LAN
    lab: 2 x 256 tokens planned h1 -> h3 over a 10 Mbit/s link at 1.47 s a run, 1 x 256 at
    0.41 s, both bound by that link at the same 1.29 ms a token)."""
    keeping = keeping_sequence(ladder)
    if len(plan_times) != len(keeping):
        raise ValueError(f"{len(plan_times)} plan times for {len(keeping)} rungs")
    feasible = [
        (times[0] / _tokens(dims), times[1] / _tokens(dims), dims)
        for dims, times in zip(keeping, plan_times, strict=True)
        if times is not None
    ]
    shorter = [dims for dims in ladder if dims not in keeping]
    if not feasible:
        return shorter
    least = min(first for first, _, _ in feasible)
    close = [(second, d) for first, second, d in feasible if first <= least * (1 + RUNG_TOLERANCE)]
    least_second = min(second for second, _ in close)
    chosen = next(d for second, d in close if second <= least_second * (1 + RUNG_TOLERANCE))
    return [chosen, *(d for _, _, d in feasible if d is not chosen), *shorter]


def _tokens(dims: Mapping[str, int]) -> int:
    return max(1, dims.get(BATCH, 1) * dims.get(SEQUENCE, 1))


def _halvings(start: int, stop: int) -> list[int]:
    values = [start]
    while values[-1] // 2 >= stop:
        values.append(values[-1] // 2)
    return values


def tokenizer_max_tokens(directory: Path) -> int:
    """The longest input a text encoder keeps (``sentence_bert_config.json``'s
    ``max_seq_length``, else :data:`DEFAULT_MAX_TOKENS`); texts are truncated to it."""
    config = directory / "sentence_bert_config.json"
    if config.is_file():
        return int(json.loads(config.read_text()).get("max_seq_length", DEFAULT_MAX_TOKENS))
    return DEFAULT_MAX_TOKENS


def sample_dims(inputs: Sequence[TensorInfo], samples: Mapping[str, Any]) -> dict[str, int]:
    """The size each symbolic dimension of the model inputs has in ``samples``."""
    sizes: dict[str, int] = {}
    for info in inputs:
        array = samples.get(info.name)
        if array is None:
            continue
        for want, size in zip(info.shape, array.shape, strict=False):
            if isinstance(want, str):
                sizes[want] = max(sizes.get(want, 0), int(size))
    return sizes


def planned_limits(manifest: Manifest, binding: Mapping[str, int]) -> ShapeLimits | None:
    """The limits every stage enforces, from the binding the deployment was planned at."""
    if manifest.sessions is not None:
        chunk = max(binding.get(SEQUENCE, 1), PREFILL_CHUNK)
        return ShapeLimits(
            dims={SEQUENCE: chunk, TOTAL_SEQUENCE: manifest.sessions.max_context},
            product_dims=[BATCH, SEQUENCE],
            product=chunk,
        )
    dims = {name: size for name, size in binding.items() if size > 0}
    if not dims:
        return None
    if BATCH in dims and SEQUENCE in dims:
        tokens = dims.pop(BATCH) * dims[SEQUENCE]
        return ShapeLimits(dims=dims, product_dims=[BATCH, SEQUENCE], product=tokens)
    return ShapeLimits(dims=dims)


def at_binding(
    inputs: Sequence[TensorInfo], samples: Mapping[str, Any], binding: Mapping[str, int]
) -> dict[str, Any] | None:
    """The samples resized (values repeated) to the planned binding, to warm the stages up at
    the shapes their memory and time were planned for; None when they already have them."""
    import numpy as np

    resized: dict[str, Any] = {}
    for info in inputs:
        array = samples[info.name]
        shape = tuple(
            binding.get(want, size) if isinstance(want, str) else size
            for want, size in zip(info.shape, array.shape, strict=True)
        )
        resized[info.name] = np.resize(array, shape) if shape != array.shape else array
    same = all(resized[i.name] is samples[i.name] for i in inputs)
    return None if same else resized
