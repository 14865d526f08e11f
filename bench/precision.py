"""What a weight precision costs next to what it saves, for one exported decoder.

For each precision (fp32 first, the reference), on fixed real text (the first tokens of the
Python standard library's ``textwrap.py``: English docstrings and code), teacher forced one
token per step through the whole model in one ONNX Runtime session:

- size: the stored bytes of ``model.onnx`` (+ ``model.onnx.data``);
- next-token top-1 agreement with fp32: the share of positions whose greedy token equals fp32's;
- perplexity of the text: ``exp`` of the mean negative log-likelihood of each next token, from
  the full logits (the input of the graph's ``TopK``, added as an output for the measurement).

    .venv/bin/python bench/precision.py --model qwen2.5-coder-1.5b --weights fp32 int8 int4 \\
        --out bench/results/precision_qwen.md

Exports are made once (``fedshard export``, then ``quantize_decoder``) and kept in the cache
(``exports/<model>``, ``exports/<model>-<weights>``), as ``bench/generate.py`` does.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from generate import prepared_export  # noqa: E402
from rich.console import Console  # noqa: E402

CACHE = REPO / ".cache" / "fedshard"
RESULTS = REPO / "bench" / "results"
TOKENS = 128
EVAL_FILE = "eval-logits.onnx"
LOGITS = "fedshard_eval_logits"


@dataclass(frozen=True)
class Measured:
    """One precision on the text."""

    weights: str
    size_bytes: int
    greedy: list[int]
    nll: list[float]
    seconds: float

    @property
    def perplexity(self) -> float:
        """exp(mean negative log-likelihood)."""
        return math.exp(sum(self.nll) / len(self.nll))


def text_ids(export: Path, count: int) -> list[int]:
    """The first ``count`` tokens of ``textwrap.py`` (fixed for a Python version)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(export / "tokenizer.json"))
    ids: list[int] = tokenizer.encode(inspect.getsource(textwrap), add_special_tokens=False).ids
    if len(ids) < count:
        raise SystemExit(f"the text gives {len(ids)} tokens, need {count}")
    return ids[:count]


def stored_bytes(export: Path) -> int:
    """Bytes of the model file and its external data."""
    return sum(f.stat().st_size for f in export.iterdir() if f.name.startswith("model.onnx"))


def with_logits(export: Path) -> Path:
    """``export/EVAL_FILE``: the model with the ``TopK`` input (full logits) as an output.

    The graph is rewritten without its weights when they are external (the copy reads the same
    ``model.onnx.data``), else with them. The caller removes the file.
    """
    import onnx

    model = onnx.load(str(export / "model.onnx"), load_external_data=False)
    [topk] = [n for n in model.graph.node if n.op_type == "TopK"]
    output = onnx.helper.make_tensor_value_info(topk.input[0], onnx.TensorProto.FLOAT, None)
    model.graph.output.append(output)
    path = export / EVAL_FILE
    onnx.save(model, str(path))
    return path


def measure(export: Path, weights: str, ids: list[int]) -> Measured:
    """Teacher-forced pass over ``ids``: greedy token and NLL of the true next token."""
    import onnxruntime as ort

    from partitioner.decoders.ort_runner import read_info
    from protocols.decoder import TOP_IDS

    info = read_info(export / "model.onnx")
    path = with_logits(export)
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        logits_name = session.get_outputs()[-1].name
        shape = (1, info.num_kv_heads, 0, info.head_dim)
        past = {p.past: np.zeros(shape, dtype=np.float32) for p in info.state}
        greedy: list[int] = []
        nll: list[float] = []
        started = time.perf_counter()
        for position, token in enumerate(ids[:-1]):
            feeds = {
                "input_ids": np.asarray([[token]], dtype=np.int64),
                "attention_mask": np.ones((1, position + 1), dtype=np.int64),
                "position_ids": np.asarray([[position]], dtype=np.int64),
                **past,
            }
            names = [TOP_IDS, logits_name, *(p.present for p in info.state)]
            top_ids, logits, *present = session.run(names, feeds)
            past = {p.past: v for p, v in zip(info.state, present, strict=True)}
            row = logits[0].astype(np.float64)
            greedy.append(int(top_ids[0, 0]))
            shift = row.max()
            log_z = shift + math.log(float(np.exp(row - shift).sum()))
            nll.append(log_z - float(row[ids[position + 1]]))
        seconds = time.perf_counter() - started
    finally:
        path.unlink(missing_ok=True)
    return Measured(weights, stored_bytes(export), greedy, nll, seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", nargs="+", default=["fp32", "int8", "int4"])
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--out", type=Path, default=RESULTS / "precision_qwen.md")
    args = parser.parse_args()
    console = Console()
    ids = text_ids(prepared_export(console, args.model, "fp32"), args.tokens)
    results: list[Measured] = []
    for weights in ["fp32", *(w for w in args.weights if w != "fp32")]:
        export = prepared_export(console, args.model, weights)
        with console.status(f"{weights}: {len(ids) - 1} teacher-forced steps"):
            results.append(measure(export, weights, ids))
        console.print(f"{weights}: perplexity {results[-1].perplexity:.3f}")
    write(args, results, len(ids))
    return 0


def write(args: argparse.Namespace, results: list[Measured], tokens: int) -> None:
    """The markdown table and the JSON numbers."""
    reference = results[0]
    rows = []
    for r in results:
        agree = sum(a == b for a, b in zip(r.greedy, reference.greedy, strict=True))
        rows.append(
            {
                "weights": r.weights,
                "size_mib": r.size_bytes / 2**20,
                "size_vs_fp32": r.size_bytes / reference.size_bytes,
                "top1_agreement": agree / len(r.greedy),
                "perplexity": r.perplexity,
                "tokens_per_s": len(r.greedy) / r.seconds,
            }
        )
    command = " ".join(sys.argv[1:])
    lines = [
        f"# Weight precision ({args.model})",
        "",
        f"`.venv/bin/python bench/precision.py {command}`: the first {tokens} tokens of Python "
        f"{sys.version_info.major}.{sys.version_info.minor}'s `textwrap.py`, teacher forced, "
        "one ONNX Runtime session per precision.",
        "",
        "| weights | stored size | vs fp32 | next-token top-1 agreement with fp32 | perplexity "
        "| teacher-forced steps/s |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['weights']} | {r['size_mib']:.0f} MiB | {r['size_vs_fp32']:.2f}x "
            f"| {100 * r['top1_agreement']:.1f}% | {r['perplexity']:.3f} "
            f"| {r['tokens_per_s']:.1f} |"
            for r in rows
        ),
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    from report.headlines import Headline, write_headlines

    headlines = [
        Headline(f"{args.model} {r['weights']}: {key}", float(r[key]), unit)
        for r in rows[1:]
        for key, unit in (("size_vs_fp32", "x"), ("top1_agreement", ""), ("perplexity", ""))
    ]
    headlines.insert(0, Headline(f"{args.model} fp32: perplexity", float(rows[0]["perplexity"])))
    write_headlines(args.out.stem, headlines, args.out.parent)
    Console().print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
