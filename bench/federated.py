"""Federated LoRA of a served chat model on real text, side by side in one run (issue 17, item 8).

The chat model (tiny Llama by default) is exported and split by the planner; three devices each
hold one WordNet domain (non-IID chat records: "What does X mean?" -> the gloss). Every mode
trains the same LoRA plan (layers ``--first-layer``.. adapted, rank 4) with the agents' real
client code (:class:`edge_agent.training.client_app.ShardClient`, via :mod:`devtools.lora_lab`):

- centralized: all three devices' records on one client (same held-out records), one "round"
  = ``local_epochs`` epochs over the pooled data;
- FedAvg: three clients, weighted FedAvg of their adapters;
- FedAvg + DP: the same with record-level DP-SGD on each client (Opacus, RDP accountant);
- FedAvg + SecAgg+ (and + DP): the same plan and shares through real Flower: a SuperLink with
  SuperNode authentication, three authenticated local SuperNodes and the product's LoRA ServerApp
  under SecAgg+ (:mod:`_federated_flower`); ``--flower-seeds`` (default 1) of the seeds,
  ``--no-flower`` skips them.

Held-out loss (nats per token, token-weighted over the devices' held-out records) of the global
model after each round, mean and spread over ``--seeds``; round time (the clients of a round run
one after another in this process; Flower: the SuperNodes in parallel); upload bytes per client
per round (SecAgg+: the masked vector) and its share of the trained segments' weights and of
the adapted layers' weights; for the SecAgg+ rows the bytes each SuperNode sent and received per
round measured on its connection to the SuperLink (all SecAgg+ stages); epsilon per round.

    .venv/bin/python bench/federated.py [--rounds 3] [--seeds 3] [--per-device 40]
        [--flower-seeds 1 | --no-flower] [--model qwen2.5-coder-1.5b --name federated_qwen]
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _federated_flower import FlowerRun, run_flower
from report.headlines import Headline, write_headlines
from rich.console import Console
from rich.table import Table

from devtools.lora_lab import (
    DOMAINS,
    LabRun,
    LoraSetup,
    lora_setup,
    run_rounds,
    split_version,
    token_mean,
)
from protocols.lora import (
    METRIC_EPSILON,
    METRIC_HELD_OUT_LOSS,
    METRIC_HELD_OUT_TOKENS,
    METRIC_TRAINED_BYTES,
    RecordDp,
)
from protocols.training import METRIC_UPLOAD_BYTES

RESULTS = Path(__file__).parent / "results"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "fedshard"
MODES = ("centralized", "FedAvg", "FedAvg + DP", "FedAvg + SecAgg+", "FedAvg + SecAgg+ + DP")
FLOWER = ("FedAvg + SecAgg+", "FedAvg + SecAgg+ + DP")


@dataclass
class ModeRuns:
    """One mode's measurements, one list entry per seed."""

    name: str
    loss: list[list[float]] = field(default_factory=list)
    """Per seed: held-out loss before round 1, then after each round."""
    round_s: list[list[float]] = field(default_factory=list)
    upload_bytes: list[float] = field(default_factory=list)
    trained_bytes: list[float] = field(default_factory=list)
    epsilon: list[list[float]] = field(default_factory=list)
    """Per seed and round: the largest device epsilon of the run so far (DP only)."""
    masked_bytes: list[float] = field(default_factory=list)
    """SecAgg+ only, per seed: the masked vector a client uploads per round."""
    adapted_bytes: list[float] = field(default_factory=list)
    """Per seed: bytes of the adapted layers' weights as the served segments store them."""
    wire_up: list[float] = field(default_factory=list)
    """SecAgg+ only, per seed: bytes a SuperNode sent per training round, measured on its TCP
    connection to the SuperLink (every SecAgg+ stage)."""
    wire_down: list[float] = field(default_factory=list)
    """SecAgg+ only, per seed: bytes a SuperNode received per training round."""
    wire_final_up: list[float] = field(default_factory=list)
    """SecAgg+ only, per seed: bytes a SuperNode sent after the last round (final evaluation)."""
    wire_idle_up: list[float] = field(default_factory=list)
    """SecAgg+ only, per seed: bytes per second a SuperNode sent while idle (polls)."""
    measured: bool = True


@dataclass(frozen=True)
class BenchModel:
    """How a served chat model is trained here: its adapted layers and the devices' budget."""

    first_layer: int
    learning_rate: float
    dp_learning_rate: float
    """DP-SGD's noisy steps make less progress at the rate that suits plain Adam."""
    device_memory_mb: int | None
    """Each device's budget when the export is split (None: lora_lab's tiny budgets)."""


MODELS = {
    "tiny-llama": BenchModel(
        first_layer=2, learning_rate=0.02, dp_learning_rate=0.02, device_memory_mb=None
    ),
    "gemma3-270m": BenchModel(
        first_layer=15, learning_rate=0.005, dp_learning_rate=0.02, device_memory_mb=300
    ),
    "qwen2.5-coder-1.5b": BenchModel(
        first_layer=26, learning_rate=0.005, dp_learning_rate=0.02, device_memory_mb=700
    ),
}
"""Gemma 3 270M as the demo trains it: its last three layers (of 18), served in int8. Without DP
it needs a lower rate than the product's 0.02 (measured, centralized, 2 rounds of 40 records a
device: 0.02 went 5.22 -> 8.92 -> 4.63 nats/token, 0.005 went 5.22 -> 2.38 -> 2.38); with DP
0.005 made less progress (5.16 -> 4.67, -9.5 %)."""


def export_dir(model: str, cache: Path) -> Path:
    """The cached export of ``model`` in its default precision (exported once, into
    ``CACHE/exports/MODEL-WEIGHTS`` as ``fedshard demo`` names it)."""
    from partitioner.models.decoders.precision import current_export, default_weights
    from partitioner.models.frontdoor import export_decoder

    weights = default_weights(model)
    out = cache / "exports" / f"{model}-{weights}"
    if not current_export(out, weights):
        export_decoder(model, out, cache_dir=cache, weights=weights, score=False)
    return out


@functools.cache
def torch_model(model: str, cache: Path) -> Any:
    """The decoder's torch definition (loaded once a process)."""
    from partitioner.models.decoders.progress import Steps
    from partitioner.models.decoders.sources import load_source

    return load_source(model, cache, Steps()).model


def held_out_curve(lab: LabRun) -> list[float]:
    """The global model's held-out loss before round 1 and after every round."""
    curve = [
        token_mean(
            [(float(m[METRIC_HELD_OUT_LOSS]), int(m[METRIC_HELD_OUT_TOKENS]), m) for _, _, m in rr]
        )
        for rr in lab.rounds
    ]
    return [*curve, token_mean(lab.final)]


def adapted_weight_bytes(setup: LoraSetup) -> int:
    """Bytes of the adapted linear layers' weights as the version's segments store them (the
    initializer each device reads for ``module.weight``, with a quantized one's scales and zero
    points; a constant shared by several layers counted once): what the adapters change, not
    the whole segments they sit in."""
    import onnx

    from edge_agent.training.lora.train import load_version

    _, blobs = load_version(setup.plan, setup.version_dir)
    sizes: dict[str, int] = {}
    for index in setup.plan.trainable:
        model = onnx.load_from_string(blobs[index])
        for t in model.graph.initializer:
            external = {e.key: e.value for e in t.external_data}
            sizes[t.name] = int(external.get("length", 0)) or len(t.raw_data) or t.ByteSize()
    counted: set[str] = set()
    for adapter in setup.plan.adapters:
        refs = setup.plan.weight_map.get(adapter.module + ".weight", [])
        ref = next((r for r in refs if r.initializer in sizes), None)
        if ref is None:
            raise SystemExit(f"no trainable segment holds {adapter.module}.weight")
        counted.add(ref.initializer)
        if ref.quantized is not None:
            counted.update(n for n in (ref.quantized.scale, ref.quantized.zero_point) if n)
    return sum(sizes[n] for n in counted if n in sizes)


def setup_for(name: str, args: argparse.Namespace, seed: int, work: Path) -> LoraSetup:
    """The mode's split version and LoRA plan (DP modes: record-level DP-SGD)."""
    bench = MODELS[args.model]
    export = export_dir(args.model, args.cache_dir)
    version = split_version(export, work / "v0001", bench.device_memory_mb)
    dp = (
        RecordDp(noise_multiplier=args.noise_multiplier, max_grad_norm=args.clip)
        if "DP" in name
        else None
    )
    return lora_setup(
        export, version, torch_model(args.model, args.cache_dir), args.first_layer, dp=dp,
        run=f"bench-{seed}",
        max_tokens=24, batch_size=args.batch_size,
        learning_rate=args.dp_learning_rate if dp else args.learning_rate,
        local_epochs=args.local_epochs,
    )  # fmt: skip


def run_mode(name: str, args: argparse.Namespace, seed: int, work: Path) -> tuple[LabRun, int]:
    """One seed of one in-process mode in its own work dir (own caches and accountant), and
    the adapted layers' bytes."""
    setup = setup_for(name, args, seed, work)
    lab = run_rounds(
        setup, work, args.rounds, args.per_device, seed=seed, pooled=name == "centralized"
    )
    return lab, adapted_weight_bytes(setup)


def secagg_mode(
    name: str, args: argparse.Namespace, seed: int, work: Path
) -> tuple[FlowerRun, int] | None:
    """One seed of a SecAgg+ mode through real Flower (and the adapted layers' bytes); None
    when not run for this seed."""
    if args.no_flower or seed >= args.flower_seeds:
        return None
    setup = setup_for(name, args, seed, work)
    run = run_flower(setup, work, args.rounds, args.per_device, seed, args.model)
    return run, adapted_weight_bytes(setup)


def measure(args: argparse.Namespace, console: Console) -> list[ModeRuns]:
    """Every mode for every seed."""
    modes = [ModeRuns(n) for n in MODES]
    with tempfile.TemporaryDirectory(prefix="fedshard-bench-lora-") as tmp:
        for seed in range(args.seeds):
            for mode in modes:
                work = Path(tmp) / f"{mode.name.replace(' ', '').replace('+', 'p')}-{seed}"
                start = time.monotonic()
                if mode.name in FLOWER:
                    flower = secagg_mode(mode.name, args, seed, work)
                    if flower is None:
                        continue
                    record_flower(mode, *flower)
                else:
                    record(mode, *run_mode(mode.name, args, seed, work))
                console.print(
                    f"seed {seed} {mode.name}: loss {[round(x, 3) for x in mode.loss[-1]]}, "
                    f"{time.monotonic() - start:.0f} s"
                )
    for mode in modes:
        mode.measured = bool(mode.loss)
    return modes


def record_flower(mode: ModeRuns, run: FlowerRun, adapted: int) -> None:
    """Add one seed's real-Flower run to ``mode``."""
    mode.adapted_bytes.append(float(adapted))
    mode.wire_up.append(run.wire_up)
    mode.wire_down.append(run.wire_down)
    mode.wire_final_up.append(run.wire_final_up)
    mode.wire_idle_up.append(run.wire_idle_up)
    mode.loss.append(run.loss)
    mode.round_s.append(run.round_s)
    mode.upload_bytes.append(run.upload_bytes)
    mode.trained_bytes.append(run.trained_bytes)
    mode.masked_bytes.append(run.masked_bytes)
    if run.epsilon:
        mode.epsilon.append(run.epsilon)


def record(mode: ModeRuns, lab: LabRun, adapted: int) -> None:
    """Add one seed's lab run to ``mode``."""
    mode.adapted_bytes.append(float(adapted))
    mode.loss.append(held_out_curve(lab))
    mode.round_s.append(lab.seconds_per_round)
    replies = [m for rr in lab.rounds for _, _, m in rr]
    mode.upload_bytes.append(float(np.mean([float(m[METRIC_UPLOAD_BYTES]) for m in replies])))
    mode.trained_bytes.append(float(np.mean([float(m[METRIC_TRAINED_BYTES]) for m in replies])))
    if all(METRIC_EPSILON in m for m in replies):
        mode.epsilon.append([max(float(m[METRIC_EPSILON]) for _, _, m in rr) for rr in lab.rounds])


def _spread(values: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    array = np.asarray(values, np.float64)
    return array.mean(axis=0), array.std(axis=0)


def _share(part: list[float], whole: list[float]) -> str:
    return f"{100 * np.mean(part) / np.mean(whole):.2f} %"


def wire(m: ModeRuns) -> str:
    """Bytes a SuperNode sent (received) per training round, measured on its connection, the
    sent bytes' share of the adapted layers' weights, and what idle polling would send in a
    round as long ("-" for in-process modes)."""
    if not m.wire_up or not any(m.wire_up):
        return "-"
    idle = np.mean(m.wire_idle_up) * np.mean(m.round_s)
    return (
        f"{np.mean(m.wire_up):,.0f} ({np.mean(m.wire_down):,.0f}); "
        f"{_share(m.wire_up, m.adapted_bytes)}; idle polls {idle:,.0f}"
    )


def rows(modes: list[ModeRuns]) -> list[tuple[str, ...]]:
    """Table rows: mode, loss per round (mean ± std), change, round s, upload (its share of
    the trained segments and of the adapted layers), wire bytes, epsilon."""
    out: list[tuple[str, ...]] = []
    for m in modes:
        if not m.measured:
            out.append((m.name, "not measured in this run", "-", "-", "-", "-", "-"))
            continue
        mean, std = _spread(m.loss)
        curve = " → ".join(f"{a:.3f}±{s:.3f}" for a, s in zip(mean, std, strict=True))
        change = f"{100 * (mean[-1] / mean[0] - 1):+.1f} %"
        round_s = f"{np.mean(m.round_s):.1f}"
        shares = (
            f"{_share(m.upload_bytes, m.trained_bytes)}; {_share(m.upload_bytes, m.adapted_bytes)}"
        )
        upload = f"{np.mean(m.upload_bytes):,.0f} ({shares})"
        name = m.name
        if m.masked_bytes:
            upload = f"{np.mean(m.upload_bytes):,.0f} masked ({shares})"
            name = f"{m.name} (Flower, {len(m.loss)} seed{'s' * (len(m.loss) > 1)})"
        eps = "-"
        if m.epsilon:
            e_mean, _ = _spread(m.epsilon)
            eps = ", ".join(f"{e:.2f}" for e in e_mean)
        out.append((name, curve, change, round_s, upload, wire(m), eps))
    return out


def report(args: argparse.Namespace, modes: list[ModeRuns], console: Console) -> None:
    """Print the table; write ``federated.md``, ``federated.json`` and ``federated.png``."""
    from partitioner.models.decoders.precision import default_weights

    header = (
        "mode",
        "held-out loss per round (mean±std)",
        "change",
        "round s",
        "upload B/client/round (of trained segments; of adapted layers)",
        "wire B/client/round sent (received); of adapted layers; idle polls",
        "ε per round",
    )
    table = Table(title=f"federated LoRA, {args.model}, {args.seeds} seeds, {args.rounds} rounds")
    for col in header:
        table.add_column(col, justify="right")
    body = rows(modes)
    for row in body:
        table.add_row(*row)
    console.print(table)
    command = (
        f"`.venv/bin/python bench/federated.py --model {args.model} --rounds {args.rounds} "
        f"--seeds {args.seeds} "
        f"--per-device {args.per_device} --local-epochs {args.local_epochs} "
        f"--batch-size {args.batch_size} --learning-rate {args.learning_rate} "
        f"--dp-learning-rate {args.dp_learning_rate} "
        f"--noise-multiplier {args.noise_multiplier} "
        + ("--no-flower`" if args.no_flower else f"--flower-seeds {args.flower_seeds}`")
    )
    lines = [
        "# Federated LoRA of a served chat model (bench/federated.py)",
        "",
        f"{command} — {args.model} exported in {default_weights(args.model)} and split by the "
        "planner, layers "
        f"{args.first_layer}.. adapted (rank 4, alpha 8), three devices with one WordNet domain "
        f"each ({', '.join(d for s in DOMAINS for d in s)}; first {args.per_device} synsets "
        f"each, chat records), {args.local_epochs} local epoch(s) per round, Adam lr "
        f"{args.learning_rate} ({args.dp_learning_rate} under DP), "
        f"batch {args.batch_size}, 24 tokens. DP: Opacus σ = {args.noise_multiplier}, "
        f"C = {args.clip}, δ = 1e-5. "
        "The devices' real client code, FedAvg in-process (devtools.lora_lab); seeds change the "
        "round-one adapters and the clients' shuffles and noise.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *[f"| {' | '.join(r)} |" for r in body],
        "",
        "Round s: the round's clients run one after another in one process (centralized: one "
        "client with all records), on a 2-core machine shared with other jobs. Upload: the "
        "adapter arrays a client returns per round, and their share of the weights of the "
        "segments it adapts and of the adapted layers' weights alone (the linear layers that "
        "get adapters, as the served segments store them: "
        + f"{max((b for m in modes for b in m.adapted_bytes), default=0):,.0f}"
        + " B). Wire (SecAgg+ rows): bytes through each SuperNode's TCP connection to the "
        "SuperLink per training round, all SecAgg+ stages, instructions, heartbeats and pulls "
        "included, measured by the kernel (tcp_info via `ss`, TCP payload with gRPC, HTTP/2 "
        "and TLS framing), cut when the ServerApp records a round; idle polls: what a "
        "SuperNode sent per second before the run started (heartbeats and message polls, "
        "measured over 10 s) times the mean round time, the part of a round's bytes that "
        "grows with its length; after the last round each SuperNode sent "
        + _final_wire(modes)
        + ". ε: the largest device's record-level ε after each round (RDP "
        "accountant, composed over the run). SecAgg+ rows: real Flower (flower-superlink with "
        "SuperNode authentication, three authenticated local SuperNodes, one per share, each "
        "with its share of the cores, and the product's LoRA ServerApp with SecAggPlusWorkflow "
        "over the adapter updates), the same plan and shares, seeds 0.. as listed (a seed picks "
        "the round-one adapters; the SuperNodes' shuffles and noise are their own); round s is "
        "the ServerApp's, from its fit instructions to the aggregate (the three devices in "
        "parallel, SecAgg+ stages included); upload is the train reply each client sends, as its "
        "upload meter (the outermost client mod) measures it: the SecAgg+-masked vector (Flower "
        "quantizes and masks every adapter array into int64: "
        + f"{max((b for m in modes for b in m.masked_bytes), default=0):,.0f}"
        + " B of arrays), not the float32 adapters.",
        "",
        f"![held-out loss per round]({args.name}.png)",
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines))
    runs = json.dumps([m.__dict__ for m in modes], indent=1)
    (RESULTS / f"{args.name}-runs.json").write_text(runs)
    plot(modes, args)
    write_headlines(args.name, headlines(modes))
    console.print(f"wrote {RESULTS / args.name}.md and {args.name}.png")


def _final_wire(modes: list[ModeRuns]) -> str:
    parts = [
        f"{np.mean(m.wire_final_up):,.0f} B ({m.name})"
        for m in modes
        if m.wire_final_up and any(m.wire_final_up)
    ]
    return ", ".join(parts) + " for the final evaluation" if parts else "nothing measured"


def headlines(modes: list[ModeRuns]) -> list[Headline]:
    """Held-out loss change per mode, federated against centralized, epsilon, upload share."""
    out = []
    by = {m.name: m for m in modes if m.measured}
    final = {n: float(_spread(m.loss)[0][-1]) for n, m in by.items()}
    first = {n: float(_spread(m.loss)[0][0]) for n, m in by.items()}
    for n in by:
        out.append(
            Headline(f"held-out loss after / before, {n}", final[n] / first[n], "x", "<= 0.9")
        )
    out.append(
        Headline(
            "final held-out loss, FedAvg / centralized", final["FedAvg"] / final["centralized"], "x"
        )
    )
    dp = by["FedAvg + DP"]
    out.append(
        Headline(
            "epsilon after the last round, FedAvg + DP",
            float(_spread(dp.epsilon)[0][-1]),
            "",
            "<= 8",
        )
    )
    share = float(np.mean(by["FedAvg"].upload_bytes) / np.mean(by["FedAvg"].trained_bytes))
    out.append(Headline("upload per round / trained segments' weights", 100 * share, "%", "<= 2"))
    adapted = float(np.mean(by["FedAvg"].upload_bytes) / np.mean(by["FedAvg"].adapted_bytes))
    out.append(Headline("upload per round / adapted layers' weights", 100 * adapted, "%"))
    for n, m in by.items():
        if m.wire_up and any(m.wire_up):
            on_wire = float(np.mean(m.wire_up) / np.mean(m.adapted_bytes))
            out.append(
                Headline(f"sent on the wire per round / adapted layers' weights, {n}",
                         100 * on_wire, "%")
            )  # fmt: skip
    return out


def plot(modes: list[ModeRuns], args: argparse.Namespace) -> None:
    """Held-out loss per round with the seeds' spread, and mean round time per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [m for m in modes if m.measured]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for m in measured:
        mean, std = _spread(m.loss)
        x = np.arange(len(mean))
        ax1.plot(x, mean, marker="o", label=m.name)
        ax1.fill_between(x, mean - std, mean + std, alpha=0.2)
    ax1.set_xlabel("round (0 = base model)")
    ax1.set_ylabel("held-out loss (nats/token)")
    ax1.set_title(f"{args.model}, {args.seeds} seeds (mean ± std)")
    ax1.legend(fontsize=8)
    ax2.bar([m.name for m in measured], [float(np.mean(m.round_s)) for m in measured])
    ax2.set_ylabel("mean round time (s)")
    ax2.tick_params(axis="x", labelrotation=15, labelsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=120)


def main() -> None:
    """Run every mode for every seed and report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny-llama")
    parser.add_argument(
        "--cache-dir", type=Path, default=CACHE, help="exports and converted checkpoints"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--per-device", type=int, default=40)
    parser.add_argument(
        "--first-layer", type=int, default=None, help="first adapted layer (default: per model)"
    )
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--learning-rate", type=float, default=None, help="Adam's (default: per model)"
    )
    parser.add_argument(
        "--dp-learning-rate", type=float, default=None, help="the DP modes' (default: per model)"
    )
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--flower-seeds", type=int, default=1, help="seeds of the SecAgg+ rows")
    parser.add_argument("--no-flower", action="store_true", help="skip the SecAgg+ (Flower) rows")
    parser.add_argument(
        "--name", default="federated", help="results file names: bench/results/NAME.md, ..."
    )
    args = parser.parse_args()
    if args.first_layer is None:
        args.first_layer = MODELS[args.model].first_layer
    if args.learning_rate is None:
        args.learning_rate = MODELS[args.model].learning_rate
    if args.dp_learning_rate is None:
        args.dp_learning_rate = MODELS[args.model].dp_learning_rate
    console = Console()
    report(args, measure(args, console), console)


if __name__ == "__main__":
    main()
