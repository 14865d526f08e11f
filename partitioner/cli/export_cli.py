"""``fedshard export``: packaged models to ONNX, decoders in the weight precision asked for."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from partitioner.cli.cli_args import EXIT_BAD_INPUT, human_size, positive_int
from partitioner.errors import GraphError
from partitioner.models.decoders.cache import CACHE_ENV, default_cache_dir
from partitioner.models.decoders.progress import RichSteps
from partitioner.models.decoders.sources import DECODER_NAMES
from partitioner.models.decoders.weights import DRAFT_BLOCK_SIZE, DRAFT_VOCABULARY, WEIGHTS
from partitioner.models.frontdoor import FRONT_DOORS


def register_export(subparsers: Any) -> None:
    """Add the ``export`` subcommand to an argparse subparsers object."""
    export = subparsers.add_parser(
        "export",
        help="export a packaged model to ONNX",
        description=(
            "Export a packaged model (real weights) to ONNX with dynamic axes. minilm writes "
            f"OUT.onnx; the decoders ({', '.join(DECODER_NAMES)}) write the directory OUT "
            "with model.onnx, decoder.json and the tokenizer files, their weights in the "
            "precision --weights names (scored against float32 on real text)."
        ),
    )
    export.add_argument("name", choices=sorted(FRONT_DOORS), help="which model")
    export.add_argument("out", type=Path, metavar="OUT", help="OUT.onnx (minilm) or OUT_DIR")
    export.add_argument(
        "--pooled", action="store_true", help="minilm: also output the sentence embedding"
    )
    export.add_argument(
        "--top-k",
        type=positive_int,
        default=64,
        metavar="K",
        help="decoders: next-token candidates the graph returns (64)",
    )
    export.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="decoders: converted checkpoints kept between runs ($FEDSHARD_CACHE, else "
        "~/.cache/fedshard)",
    )
    export.add_argument(
        "--weights",
        choices=WEIGHTS,
        default=None,
        help="decoders: weight precision (default: int8 for gemma3-270m, int4 for the Qwen "
        "models, fp32 for the tiny test models)",
    )
    export.add_argument(
        "--no-score",
        action="store_true",
        help="decoders: skip scoring the precision against float32",
    )
    export.add_argument(
        "--draft",
        type=positive_int,
        nargs="?",
        const=DRAFT_VOCABULARY,
        default=None,
        metavar="TOKENS",
        help="decoders: a draft-only export for speculative decoding (int4 in blocks of "
        f"{DRAFT_BLOCK_SIZE}, the output head cut to the TOKENS most frequent tokens, "
        f"{DRAFT_VOCABULARY} when not given, plus the special ones); never served",
    )
    export.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Handler of ``fedshard export``."""
    import os

    from rich.console import Console

    console = Console()
    options: dict[str, Any] = {"pooled": args.pooled}
    if args.name in DECODER_NAMES:
        cache_dir = args.cache_dir or default_cache_dir(os.environ.get(CACHE_ENV))
        options = {"top_k": args.top_k, "cache_dir": cache_dir, "steps": RichSteps(console)}
        if args.weights is not None:
            options["weights"] = args.weights
        if args.no_score:
            options["score"] = False
        if args.draft is not None:
            options["draft_vocabulary"] = args.draft
    try:
        result = FRONT_DOORS[args.name](args.out, **options)
    except (GraphError, OSError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return EXIT_BAD_INPUT
    outputs = list(result.outputs)
    shown = ", ".join(outputs if len(outputs) <= 4 else [*outputs[:3], f"... ({len(outputs)})"])
    console.print(
        f"wrote {result.path} ({human_size(result.param_bytes)} of weights, outputs "
        f"{shown}); ONNX Runtime vs PyTorch max abs diff {result.max_abs_diff:.3g}"
    )
    if result.precision is not None:
        print_precision(console, result.precision, result.quality)
    return 0


def print_precision(console: Any, report: Any, quality: Any) -> None:
    """One table: the precision's size next to float32's, and its score on real text."""
    from rich.table import Table

    table = Table(title=f"{report.weights} against fp32")
    for column in ("weights", "size", "vs fp32", "top-1 agreement", "perplexity"):
        table.add_column(column, justify="right")
    scored = quality is not None
    table.add_row(
        "fp32",
        human_size(report.source_bytes),
        "1.00x",
        "1.000" if scored else "-",
        f"{quality.reference_perplexity:.2f}" if scored else "-",
    )
    table.add_row(
        report.weights,
        human_size(report.weight_bytes),
        f"{report.ratio:.2f}x",
        f"{quality.top1_agreement:.3f}" if scored else "-",
        f"{quality.perplexity:.2f}" if scored else "-",
    )
    console.print(table)
    if scored:
        console.print(f"scored on {quality.tokens} tokens of Python's 'Execution model' text")
