"""Federated LoRA lab: a decoder (or MiniLM) split by the planner, its LoRA plan, WordNet shares,
and plain FedAvg rounds over the agents' real client code (no Flower processes). Tests and
benches use it.

    python -m devtools.lora_lab EXPORT_DIR WORK_DIR [--rounds 2] [--per-device 100]
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from devtools.wordnet import write_shares
from partitioner.models.lora import (
    Q_PROJECTIONS,
    adapter_specs,
    initial_adapters,
    layer_boundary,
    torch_params,
    weight_map,
)
from protocols.lora import ENCODER_DEFAULT_TARGETS, LoraPlan, LoraSettings, RecordDp, SegmentRef
from protocols.manifest import MANIFEST_FILE, Manifest

DOMAINS = (("noun.animal",), ("noun.food",), ("noun.plant",))
"""One WordNet domain per device: non-IID shares."""
DEVICES = {
    "devices": [
        {"name": n, "memory_bytes": 16_000_000, "gflops": 10, "bandwidth_mbps": 1000}
        for n in ("a", "b", "c")
    ]
}
ENCODER_DEVICES = {
    "devices": [
        {"name": n, "memory_bytes": m, "gflops": 10, "bandwidth_mbps": 1000}
        for n, m in (("a", 70_000_000), ("b", 30_000_000), ("c", 30_000_000))
    ]
}
"""MiniLM's 90 MB on three agents (its 46 MB word embeddings need the big one)."""


@dataclass(frozen=True)
class LoraSetup:
    """A split version dir (with tokenizer), the full model's torch params and the plan."""

    version_dir: Path
    plan: LoraPlan
    initial: list[np.ndarray]
    model: Any


def split_version(export_dir: Path, out_dir: Path, memory_mb: int | None = None) -> Path:
    """``fedshard split`` the export onto :data:`DEVICES` (each with ``memory_mb`` MB when
    given: a real decoder needs more); copy its tokenizer next to it."""
    devices = DEVICES if memory_mb is None else _devices(memory_mb)
    return _split(export_dir / "model.onnx", export_dir / "tokenizer.json", devices, out_dir)


def split_encoder(onnx_path: Path, out_dir: Path) -> Path:
    """``fedshard split`` exported MiniLM onto :data:`ENCODER_DEVICES`, with its tokenizer."""
    from partitioner.models.packaged import minilm_dir

    tokenizer = minilm_dir() / "tokenizer.json"
    return _split(onnx_path, tokenizer, ENCODER_DEVICES, out_dir)


def _split(onnx_path: Path, tokenizer: Path, devices: dict[str, Any], out_dir: Path) -> Path:
    from partitioner.cutting.split import split_model
    from protocols.devices import DeviceList

    split_model(onnx_path, DeviceList.model_validate(devices), out_dir)
    shutil.copy(tokenizer, out_dir / "tokenizer.json")
    return out_dir


def minilm_model() -> Any:
    """all-MiniLM-L6-v2 as transformers' ``BertModel`` (the package's weights, offline)."""
    from transformers import AutoModel

    from partitioner.models.packaged import minilm_dir, offline

    offline()
    return AutoModel.from_pretrained(minilm_dir()).eval()


def encoder_setup(
    onnx_path: Path, version_dir: Path, model: Any, first_layer: int, *, dp: RecordDp | None,
    settings: LoraSettings | None = None, run: str = "test-run", **plan_fields: Any,
) -> LoraSetup:  # fmt: skip
    """The contrastive plan that adapts BERT layers ``first_layer ..`` of ``version_dir``."""
    settings = settings or LoraSettings(
        rank=4, alpha=8.0, target_modules=list(ENCODER_DEFAULT_TARGETS)
    )
    return _setup(
        onnx_path, version_dir, model, first_layer, dp=dp, settings=settings, run=run,
        objective="contrastive", **plan_fields,
    )  # fmt: skip


def lora_setup(
    export_dir: Path,
    version_dir: Path,
    model: Any,
    first_layer: int,
    *,
    dp: RecordDp | None,
    settings: LoraSettings | None = None,
    run: str = "test-run",
    **plan_fields: Any,
) -> LoraSetup:
    """The plan that adapts layers ``first_layer ..`` of the split ``version_dir``."""
    settings = settings or LoraSettings(rank=4, alpha=8.0)
    return _setup(
        export_dir / "model.onnx", version_dir, model, first_layer, dp=dp, settings=settings,
        run=run, **plan_fields,
    )  # fmt: skip


def _setup(
    onnx_path: Path, version_dir: Path, model: Any, first_layer: int, *, dp: RecordDp | None,
    settings: LoraSettings, run: str, **plan_fields: Any,
) -> LoraSetup:  # fmt: skip
    full = onnx.load(onnx_path)
    params = {k: v for k, v in torch_params(model).items() if not k.startswith("pooler.")}
    wmap = weight_map(params, full)
    boundary = layer_boundary(full, wmap, first_layer)
    manifest = Manifest.from_json((version_dir / MANIFEST_FILE).read_bytes())
    keys = {q.format(i=first_layer) for q in Q_PROJECTIONS}
    q_key = next(k for k in wmap if any(k.endswith(q) for q in keys))
    q_name = wmap[q_key][0].initializer
    first_trainable = next(
        e.index
        for e in manifest.segments
        if q_name in {t.name for t in onnx.load(version_dir / e.file).graph.initializer}
    )
    specs = adapter_specs({k: v.shape for k, v in params.items()}, first_layer, settings)
    plan = LoraPlan(
        run=run,
        architecture=type(model).__name__,
        config=model.config.to_json_string(),
        first_layer=first_layer,
        boundary=boundary,
        segments=[SegmentRef(index=e.index, sha256=e.sha256) for e in manifest.segments],
        trainable=list(range(first_trainable, len(manifest.segments))),
        weight_map={k: list(v) for k, v in wmap.items()},
        adapters=specs,
        lora=settings,
        dp=dp,
        tokenizer_sha256=hashlib.sha256((version_dir / "tokenizer.json").read_bytes()).hexdigest(),
        **plan_fields,
    )
    return LoraSetup(version_dir, plan, initial_adapters(specs, settings.rank, seed=0), model)


def fedavg(replies: Sequence[Sequence[np.ndarray]], weights: Sequence[float]) -> list[np.ndarray]:
    """Weighted mean of each array over the replies."""
    w = np.asarray(weights, np.float64) / float(sum(weights))
    return [
        np.tensordot(w, np.stack([np.asarray(r[k], np.float64) for r in replies]), axes=1).astype(
            np.float32
        )
        for k in range(len(replies[0]))
    ]


def plan_config(plan: LoraPlan, round_number: int) -> dict[str, Any]:
    """The fit config a ServerApp sends for a LoRA round."""
    from protocols.lora import LORA_PLAN_KEY

    return {LORA_PLAN_KEY: plan.model_dump_json(), "round": round_number}


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class LabRun:
    """What :func:`run_rounds` measured."""

    setup: LoraSetup
    data_dirs: list[Path]
    baseline: list[tuple[float, int, dict[str, Any]]]
    rounds: list[list[tuple[list[np.ndarray], int, dict[str, Any]]]]
    final: list[tuple[float, int, dict[str, Any]]]
    arrays: list[np.ndarray]
    seconds_per_round: list[float]


def token_mean(results: Sequence[tuple[float, int, dict[str, Any]]]) -> float:
    """Token-weighted mean of the devices' held-out losses (a device without held-out tokens
    reports a NaN loss and weighs nothing)."""
    held = [(loss, n) for loss, n, _ in results if n > 0]
    return sum(loss * n for loss, n in held) / sum(n for _, n in held)


def pair_recall(results: Sequence[tuple[float, int, dict[str, Any]]]) -> float:
    """Held-out recall@1 of an encoder's evaluations, weighted by each device's held-out pairs."""
    from protocols.lora import METRIC_RECALL_AT_1

    pairs = sum(n for _, n, _ in results)
    return sum(float(m[METRIC_RECALL_AT_1]) * n for _, n, m in results) / pairs


def run_rounds(
    setup: LoraSetup,
    work_dir: Path,
    rounds: int,
    per_device: int,
    *,
    domains: Sequence[Sequence[str]] = DOMAINS,
    seed: int = 0,
    pooled: bool = False,
) -> LabRun:
    """One device per ``domains`` entry (its first ``per_device`` synsets of each domain),
    ``rounds`` FedAvg rounds of their real clients. ``seed`` picks the round-one adapters and,
    without DP, the clients' shuffles (a DP round draws its sampling and noise from
    os.urandom); ``pooled`` puts every share's records on one client (the centralized
    baseline: the same records, train and held out, as the federated run's)."""
    import time

    from edge_agent.training.client_app import ShardClient
    from edge_agent.training.local import LocalSettings

    pairs = setup.plan.objective == "contrastive"
    dirs = write_shares(work_dir / "data", domains, per_device=per_device, pairs=pairs)
    if pooled:
        dirs = [_pool(dirs, work_dir / "data" / "pooled")]
    clients = [
        ShardClient(
            LocalSettings(setup.version_dir, d, work_dir / f"cache-{i}", 1 << 30), 1000 * seed + i
        )
        for i, d in enumerate(dirs)
    ]
    arrays = setup.initial
    if seed:
        arrays = initial_adapters(setup.plan.adapters, setup.plan.lora.rank, seed=seed)
    baseline = [c.evaluate(arrays, plan_config(setup.plan, 0)) for c in clients]
    replies_per_round, seconds = [], []
    for r in range(1, rounds + 1):
        start = time.monotonic()
        replies = [_in_lab(c, c.fit(arrays, plan_config(setup.plan, r))) for c in clients]
        seconds.append(time.monotonic() - start)
        replies_per_round.append(replies)
        arrays = fedavg([a for a, _, _ in replies], [w for _, w, _ in replies])
    final = [c.evaluate(arrays, plan_config(setup.plan, 0)) for c in clients]
    return LabRun(setup, dirs, baseline, replies_per_round, final, arrays, seconds)


def _in_lab(client: Any, reply: Any) -> Any:
    """A fit reply with every metric the client computed: under DP the reply a device sends
    leaves out what is derived from its records (``protocols.privacy``), but a lab is the
    records' owner and reports them (``ShardClient.local_metrics``)."""
    arrays, weight, metrics = reply
    return arrays, weight, {**metrics, **client.local_metrics}


def _pool(dirs: Sequence[Path], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    text = "".join((d / "wordnet.jsonl").read_text(encoding="utf-8") for d in dirs)
    (out / "wordnet.jsonl").write_text(text, encoding="utf-8")
    return out


def _devices(memory_mb: int) -> dict[str, Any]:
    """:data:`DEVICES` with another memory budget each (a real decoder needs more)."""
    return {"devices": [{**d, "memory_bytes": memory_mb * 1_000_000} for d in DEVICES["devices"]]}


def main(argv: list[str] | None = None) -> int:
    """Run the lab on an exported decoder and print its measurements as JSON."""
    import argparse

    from partitioner.models.decoders.progress import Steps
    from partitioner.models.decoders.sources import load_source

    parser = argparse.ArgumentParser(prog="python -m devtools.lora_lab")
    parser.add_argument("export_dir", type=Path, help="a decoder export (fp32, int8 or int4)")
    parser.add_argument("work_dir", type=Path)
    parser.add_argument(
        "--model", choices=["tiny-llama", "tiny-gemma3", "gemma3-270m"], default="tiny-llama"
    )
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "fedshard")
    parser.add_argument("--device-memory-mb", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--per-device", type=int, default=100)
    parser.add_argument("--first-layer", type=int, default=2)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=0.02)
    parser.add_argument("--local-epochs", type=int, default=2)
    args = parser.parse_args(argv)
    model = load_source(args.model, args.cache_dir, Steps()).model
    version = split_version(args.export_dir, args.work_dir / "v0001", args.device_memory_mb)
    dp = RecordDp(noise_multiplier=args.noise_multiplier) if args.noise_multiplier else None
    setup = lora_setup(
        args.export_dir, version, model, args.first_layer, dp=dp,
        settings=LoraSettings(rank=args.rank, alpha=2.0 * args.rank),
        max_tokens=args.max_tokens, batch_size=args.batch_size,
        learning_rate=args.learning_rate, local_epochs=args.local_epochs,
    )  # fmt: skip
    lab = run_rounds(setup, args.work_dir, args.rounds, args.per_device)
    print(json.dumps(lab_summary(lab), indent=2))
    return 0


def lab_summary(lab: LabRun) -> dict[str, Any]:
    """What a lab run measured, as JSON data."""
    last = lab.rounds[-1]
    return {
        "held_out_loss_before": token_mean(lab.baseline),
        "held_out_loss_after": token_mean(lab.final),
        "epsilon_per_device": [m.get("epsilon") for _, _, m in last],
        "upload_bytes_per_device": [m["upload-bytes"] for _, _, m in last],
        "trained_segment_bytes": [m["trained-shard-bytes"] for _, _, m in last],
        "peak_rss_bytes": [m["peak-rss-bytes"] for _, _, m in last],
        "seconds_per_round": lab.seconds_per_round,
        "train_records": [m["examples"] for _, _, m in last],
    }


if __name__ == "__main__":
    raise SystemExit(main())
