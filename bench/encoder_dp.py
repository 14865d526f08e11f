"""Contrastive LoRA of MiniLM under record-level DP: which settings keep the recall gain (issue 17).

all-MiniLM-L6-v2 is exported (real weights) and split by the planner onto three agents; each
device holds the first ``--per-device`` synsets of one WordNet domain as ``{"anchor",
"positive"}`` pairs (noun.animal, noun.food, noun.plant: non-IID, about 10 % held out). Every
configuration trains BERT layers ``--first-layer``.. with the agents' real client code
(:mod:`devtools.lora_lab`: plain FedAvg, no Flower processes) for ``--rounds`` rounds, once per
seed (the seed picks the round-one adapters, the clients' shuffles and the DP noise):

- ``no DP``: the reference, Adam at lr 0.001 on every BERT module (query, key, value, dense);
- ``DP, before``: what the coordinator planned until 2026-12-06 (every module, batch 16,
  2 local epochs, lr 0.01, sigma 1.0, C 1.0);
- ``DP, default``: the coordinator's :class:`LoraTuning` today (query and value only, its
  encoder batch size and epochs);
- ``DP, default, sigma 1.3``: the same with more noise (a smaller epsilon).

Printed and written to ``bench/results/encoder_dp.md``: held-out recall@1 before and after
(pair-weighted over the devices' held-out pairs), the largest device epsilon at delta 1e-5,
seconds per round (three clients one after another in this process).

    .venv/bin/python bench/encoder_dp.py [--per-device 300] [--seeds 2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from report.headlines import Headline, write_headlines
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from coordinator.training.lora.plan import LoraTuning
from devtools.lora_lab import (
    LabRun,
    encoder_setup,
    minilm_model,
    pair_recall,
    run_rounds,
    split_encoder,
)
from protocols.lora import (
    ENCODER_DEFAULT_TARGETS,
    ENCODER_TARGETS,
    METRIC_EPSILON,
    LoraSettings,
    RecordDp,
)

RESULTS = Path(__file__).parent / "results"
TUNING = LoraTuning()


@dataclass(frozen=True)
class Config:
    """One way of training the encoder's adapters."""

    name: str
    targets: tuple[str, ...]
    batch_size: int
    local_epochs: int
    learning_rate: float
    noise_multiplier: float | None
    """None: no DP."""


CONFIGS = (
    Config("no DP", ENCODER_TARGETS, 16, 2, 0.001, None),
    Config("DP, before", ENCODER_TARGETS, 16, 2, 0.01, 1.0),
    Config(
        "DP, default",
        ENCODER_DEFAULT_TARGETS,
        TUNING.encoder_batch_size,
        TUNING.encoder_local_epochs,
        TUNING.encoder_learning_rate,
        TUNING.noise_multiplier,
    ),
    Config(
        "DP, default, sigma 1.3",
        ENCODER_DEFAULT_TARGETS,
        TUNING.encoder_batch_size,
        TUNING.encoder_local_epochs,
        TUNING.encoder_learning_rate,
        1.3,
    ),
)


@dataclass
class ConfigRuns:
    """A configuration's measurements, one entry per seed."""

    config: Config
    before: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    epsilon: list[float] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)
    held_out: int = 0


def run_config(
    config: Config, onnx_path: Path, version: Path, model: Any, work: Path, args: argparse.Namespace
) -> list[LabRun]:
    """Every seed's lab run of ``config``."""
    dp = None
    if config.noise_multiplier is not None:
        dp = RecordDp(noise_multiplier=config.noise_multiplier, max_grad_norm=TUNING.max_grad_norm)
    setup = encoder_setup(
        onnx_path, version, model, args.first_layer, dp=dp,
        settings=LoraSettings(
            rank=args.rank, alpha=2.0 * args.rank, target_modules=list(config.targets)
        ),
        max_tokens=TUNING.encoder_max_tokens, batch_size=config.batch_size,
        learning_rate=config.learning_rate, local_epochs=config.local_epochs,
    )  # fmt: skip
    return [
        run_rounds(setup, work / f"seed{seed}", args.rounds, args.per_device, seed=seed)
        for seed in range(args.seeds)
    ]


def measure(config: Config, labs: list[LabRun]) -> ConfigRuns:
    """The numbers of one configuration's runs."""
    runs = ConfigRuns(config, held_out=sum(n for _, n, _ in labs[0].baseline))
    for lab in labs:
        runs.before.append(pair_recall(lab.baseline))
        runs.after.append(pair_recall(lab.final))
        runs.round_s.append(sum(lab.seconds_per_round) / len(lab.seconds_per_round))
        eps = [float(m.get(METRIC_EPSILON, "nan")) for _, _, m in lab.rounds[-1]]
        runs.epsilon.append(max(eps))
    return runs


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def table(all_runs: list[ConfigRuns], args: argparse.Namespace) -> tuple[Table, str]:
    """The results as a rich table and as Markdown."""
    head = ["configuration", "modules", "batch", "epochs", "lr", "sigma", "recall@1 before",
            "recall@1 after (per seed)", "after / before", "epsilon", "s / round"]  # fmt: skip
    rich_table = Table(*head, title=f"MiniLM contrastive LoRA, {args.per_device} pairs a device")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in all_runs:
        c = r.config
        row = [
            c.name, "/".join(c.targets), str(c.batch_size), str(c.local_epochs),
            str(c.learning_rate), "-" if c.noise_multiplier is None else str(c.noise_multiplier),
            f"{_mean(r.before):.3f}", ", ".join(f"{a:.3f}" for a in r.after),
            f"{_mean(r.after) / _mean(r.before):.3f}x",
            "-" if c.noise_multiplier is None else f"{max(r.epsilon):.2f}",
            f"{_mean(r.round_s):.0f}",
        ]  # fmt: skip
        rich_table.add_row(*row)
        lines.append("| " + " | ".join(row) + " |")
    return rich_table, "\n".join(lines)


def headlines(all_runs: list[ConfigRuns]) -> list[Headline]:
    """Recall after / before for each configuration, the default's epsilon and its recall gain
    against the no-DP reference's."""
    by = {r.config.name: r for r in all_runs}
    out = [
        Headline(
            f"held-out recall@1 after / before, {r.config.name}",
            _mean(r.after) / _mean(r.before),
            "x",
            ">= 1.05" if r.config.name == "DP, default" else None,
        )
        for r in all_runs
    ]
    default, plain = by["DP, default"], by["no DP"]
    out.append(Headline("epsilon after the run, DP, default", max(default.epsilon), "", "<= 8"))
    gain_plain = _mean(plain.after) - _mean(plain.before)
    if gain_plain > 0:
        gain = (_mean(default.after) - _mean(default.before)) / gain_plain
        out.append(Headline("recall@1 gain, DP default / no DP", gain, "x", ">= 0.5"))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every configuration and write the results."""
    parser = argparse.ArgumentParser(prog="bench/encoder_dp.py")
    parser.add_argument("--per-device", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--first-layer", type=int, default=4)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS / "encoder_dp.md")
    args = parser.parse_args(argv)
    from partitioner.models.frontdoor import export_minilm

    console = Console()
    all_runs = []
    with tempfile.TemporaryDirectory(prefix="encoder-dp-") as tmp:
        root = Path(tmp)
        onnx_path = export_minilm(root / "minilm.onnx", pooled=True).path
        version = split_encoder(onnx_path, root / "v0001")
        model = minilm_model()
        with Progress(console=console) as progress:
            task = progress.add_task("configurations", total=len(CONFIGS))
            for i, config in enumerate(CONFIGS):
                start = time.monotonic()
                labs = run_config(config, onnx_path, version, model, root / f"c{i}", args)
                all_runs.append(measure(config, labs))
                progress.advance(task)
                progress.console.print(f"{config.name}: {time.monotonic() - start:.0f} s")
    rich_table, markdown = table(all_runs, args)
    console.print(rich_table)
    doc = (
        "# Encoder LoRA under DP: recall@1 by configuration\n\n"
        f"`.venv/bin/python bench/encoder_dp.py --per-device {args.per_device} --seeds "
        f"{args.seeds} --rounds {args.rounds}`: all-MiniLM-L6-v2, BERT layers "
        f"{args.first_layer}.. at rank {args.rank}, three devices (noun.animal, noun.food, "
        f"noun.plant pairs), {all_runs[0].held_out} held-out pairs in all, delta 1e-5, "
        f"C = {TUNING.max_grad_norm}.\n\n{markdown}\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(doc)
    if args.out.parent == RESULTS:
        write_headlines(args.out.stem, headlines(all_runs))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
