"""Demo and benchmark steps for a decoder: export it, deploy it across the agents, chat with it.

Used by ``fedshard demo`` and ``bench/generate.py``; everything goes through the same CLI and
HTTP API a user has (``fedshard export``, ``POST /v1/deployments``, ``/v1/chat/completions``).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from devtools.demo.procs import fedshard_command
from devtools.demo.steps import Api, DemoStepError, post_deployment
from partitioner.models.decoders.precision import current_export, parse_weights
from protocols.decoder import DECODER_FILE, MODEL_FILE, DecoderInfo

CHAT_TOKENS = 48
"""The demo's answers: at most this many new tokens."""
CAP_SHARE = 0.8
"""Each device's planning cap as a share of the model's weights: with the tied embedding held
by both the first and the last stage, no two devices can hold the model; three can, so the
demo's four agents still serve it after losing one."""
LARGE_SHARE = 0.45
"""The cap of a model larger than an agent's whole budget (Qwen 1.5B): under half of it on
each agent, so it runs split over agents none of which holds half of it, as on 512 MiB
devices; three such caps still hold it with its KV cache after losing an agent."""


def export_decoder(
    console: Console, name: str, out: Path, cache_dir: Path, weights: str = "fp32"
) -> Path:
    """``fedshard export NAME OUT --weights W --no-score`` unless ``OUT`` already holds the
    export; returns ``OUT``. (Scoring the precision against float32 is the export's own report,
    see the README; the demo skips it.)"""
    if current_export(out, parse_weights(weights)):
        console.print(f"[green]{name}[/] ({weights}) already exported in {out}")
        return out
    command = [
        *fedshard_command(), "export", name, str(out), "--cache-dir", str(cache_dir),
        "--weights", weights, "--no-score",
    ]  # fmt: skip
    console.print(f"exporting {name} in {weights} (the first time converts the weights; cached)")
    started = time.monotonic()
    done = subprocess.run(command, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise DemoStepError(f"`{' '.join(command)}` failed with exit code {done.returncode}")
    console.print(f"[green]exported {name}[/] in {time.monotonic() - started:.0f} s")
    return out


def decoder_info(export: Path) -> DecoderInfo:
    """The export's ``decoder.json``."""
    return DecoderInfo.from_json((export / DECODER_FILE).read_bytes())


def decoder_caps(export: Path, names: Sequence[str], budget_bytes: int) -> dict[str, int]:
    """Planning caps under which no one device can hold the model (and, where its embedding
    is tied, no two); a model whose weights exceed every budget is capped at under half of
    its weights on each device (:data:`LARGE_SHARE`)."""
    weights = (export / MODEL_FILE).stat().st_size
    share = LARGE_SHARE if weights > budget_bytes else CAP_SHARE
    return {name: int(share * weights) for name in names}


def deploy_decoder(
    console: Console, api: Api, export: Path, model_id: str, caps: dict[str, int]
) -> dict[str, Any]:
    """POST /v1/deployments for the export (its directory is the tokenizer directory)."""
    body = {
        "model_path": str((export / MODEL_FILE).resolve()),
        "model_id": model_id,
        "memory_caps": caps,
        "tokenizer_dir": str(export.resolve()),
    }
    started = time.monotonic()
    with console.status(f"deploying {model_id}: planning, cutting, pushing, warm-up, health..."):
        reply = post_deployment(api, body)
    console.print(
        f"[green]deployed {model_id} v{reply['version']}[/] in "
        f"{time.monotonic() - started:.1f} s across {len(reply['segments'])} devices"
    )
    return dict(reply)


def chat(
    api: Api, model_id: str, question: str, max_tokens: int = CHAT_TOKENS, stop: Sequence[str] = ()
) -> dict[str, Any]:
    """One greedy chat completion (not streamed); the response body."""
    body: dict[str, Any] = {
        "model": model_id,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stop:
        body["stop"] = list(stop)
    code, reply = api.call("POST", "/v1/chat/completions", body, timeout=600)
    if code != 200:
        raise DemoStepError(f"chat completion failed ({code}): {json.dumps(reply)[:400]}")
    return dict(reply)
