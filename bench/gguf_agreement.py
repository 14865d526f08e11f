"""The packaged Qwen2.5-Coder-1.5B GGUF served through the segment builder (``--weights keep``)
against llama.cpp on the same file (issue 40 item 5).

A fixed English passage is tokenized by llama.cpp with the file's own tokenizer; llama.cpp
(node-llama-cpp's prebuilt CPU binary, ``make bench-setup``) scores every position
teacher-forced, twice: in one pass (batch 512, the reference) and one token at a time (batch 1,
the path decoding takes): its top-1 next token, the log-probability of the text's next token
and every logit. The two passes' agreement with each other is llama.cpp's own noise floor.
fedshard serves the same file (``POST /v1/deployments`` of the ``.gguf``, weights ``keep``) on
four agents of 1 GiB planned under caps of 45 % of the model's stored weights, so each holds
less than half of it. Teacher-forced top-1 through the agents: for every prefix, one greedy
token from ``/v1/completions`` (token-id prompt, ``max_tokens`` 1), compared with llama.cpp's
top-1 as text. Perplexity needs the full distribution, which the served head does not return
(its top-k only): the same stages' segments (the deployed plan's unit ranges, the same builder,
weights and accuracy level) are rebuilt with a full-vocabulary head and run chained here, and
again at accuracy level 0 (float activations). Position 0 (one token, no BOS: Qwen's residual
stream carries a ~3.7e3 outlier there) is also computed by the numpy reference
(:mod:`partitioner.models.gguf.reference`, float64) as it is and with llama.cpp's Q8_K rounding
of every product's input, which tells whose arithmetic a gap there comes from. Writes
``bench/results/gguf_agreement.md``::

    .venv/bin/python bench/gguf_agreement.py [--tokens 96] [--threads 1]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import secrets
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402

from coordinator.deploy.store import segment_dir  # noqa: E402
from coordinator.errors import ApiError  # noqa: E402
from devtools.demo.gguf import deploy_gguf, gguf_caps, packaged_gguf, stored_bytes  # noqa: E402
from devtools.demo.procs import demo_processes, free_port  # noqa: E402
from devtools.demo.steps import Api, pair_automatically  # noqa: E402
from partitioner.models.gguf.builder import GgufSource  # noqa: E402
from partitioner.models.gguf.kernels import ACCURACY_LEVEL  # noqa: E402
from protocols.manifest import MANIFEST_FILE  # noqa: E402
from protocols.sizes import parse_size  # noqa: E402

MODEL = "qwen2.5-coder-1.5b"
AGENTS = 4
MEMORY = "1GiB"
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type with an oil-based ink and a screw press. Within "
    "fifty years presses were operating in more than two hundred cities across Europe, and "
    "the cost of books fell sharply. Pamphlets, calendars and newspapers followed, and "
    "reading spread from monasteries and universities to merchants and craftsmen. Scholars "
    "could compare identical copies of a text for the first time, which changed how science "
    "was done: an error found in one city could be corrected in the next edition everywhere."
)
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
from _llama_cpp import llama_cpp_score  # noqa: E402
from report.headlines import Headline, write_headlines  # noqa: E402
from report.machine import commit  # noqa: E402

RESULTS = HERE / "results" / "gguf_agreement.md"
MB = 1e6


@dataclass(frozen=True)
class Scores:
    """Teacher-forced next-token scores of positions 0..n-2."""

    top: list[int]
    logprob: list[float]

    def perplexity(self) -> float:
        """exp of the mean negative log-likelihood of the text's next tokens."""
        return math.exp(-float(np.mean(self.logprob)))


@dataclass(frozen=True)
class LlamaPass:
    """One teacher-forced llama.cpp pass: the text's ids, the scores, every logit
    ``[n - 1, vocab]`` and the process's resident bytes."""

    ids: list[int]
    scores: Scores
    logits: np.ndarray
    resident_bytes: int


def llama_cpp(gguf: Path, tokens: int, threads: int, batch_size: int) -> LlamaPass:
    """llama.cpp's teacher-forced pass over the text, ``batch_size`` tokens per evaluation."""
    vocab = GgufSource(gguf).model.vocab
    with tempfile.TemporaryDirectory(prefix="llama-logits-") as tmp:
        path = Path(tmp) / "logits.f32"
        reply = llama_cpp_score(gguf, TEXT, tokens, threads, batch_size, path, vocab)
        logits = np.fromfile(path, np.float32).reshape(-1, vocab)
    scores = Scores(list(reply.top), list(reply.logprob))
    return LlamaPass(list(reply.ids), scores, logits, reply.resident_bytes)


def position_zero(gguf: Path, token: int) -> tuple[np.ndarray, np.ndarray]:
    """The numpy reference's logits after the text's first token alone (float64), as it is
    and with llama.cpp's Q8_K rounding of every weight product's input."""
    from partitioner.models.gguf.reference import dequantized, forward, q8_k

    source = GgufSource(gguf)
    w = dequantized(source.model, source.raw)
    exact = forward(source.model, w, [token])[0]
    rounded = forward(source.model, w, [token], activations=q8_k)[0]
    return exact, rounded


def token_texts(gguf: Path, ids: list[int]) -> list[str]:
    """Each id's text under the file's own tokenizer (as the coordinator writes it)."""
    from tokenizers import Tokenizer

    from coordinator.deploy.gguf_tokenizer import write_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        write_tokenizer(gguf, path)
        tokenizer = Tokenizer.from_file(str(path))
    return [tokenizer.decode([i], skip_special_tokens=True) for i in ids]


def served(
    console: Console, gguf: Path, ids: list[int], keep: Path | None = None
) -> tuple[list[str], dict[str, Any]]:
    """Deploy the file on the agents; each prefix's greedy next token (text) through them, and
    the deployment (its placements and each stage's unit range). ``keep``: their state and
    logs there instead of in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="fedshard-agreement-") as tmp:
        work = keep or Path(tmp)
        with demo_processes(work / "logs") as procs:
            coordinator = procs.start_coordinator(work / "coordinator", free_port())
            suffix = secrets.token_hex(2)
            names = [f"agree{i}-{suffix}" for i in range(AGENTS)]
            first, dirs = None, {}
            for name in names:
                child = procs.start_agent(name, MEMORY, work / name, profile_from=first)
                first = first or child.state_dir / "profile.json"
                dirs[name] = child.state_dir
            api = Api(coordinator.url, coordinator.token)
            pair_automatically(console, api, dirs, procs.check_alive)
            caps = gguf_caps(gguf, names, parse_size(MEMORY))
            version = deploy_gguf(console, api, gguf, MODEL, caps)
            client = api.client(timeout=600)
            client.set_speculative(MODEL, "off")
            folder = segment_dir(work / "coordinator", MODEL, int(version["plan_version"]))
            manifest_path = folder / MANIFEST_FILE
            manifest = json.loads(manifest_path.read_text())
            texts = []
            with console.status("teacher-forced top-1 through the agents...") as status:
                for n in range(1, len(ids)):
                    status.update(f"teacher-forced top-1 through the agents: {n}/{len(ids) - 1}")
                    body = {"model": MODEL, "prompt": ids[:n], "max_tokens": 1, "temperature": 0}
                    try:
                        reply = client.expect("POST", "/v1/completions", body)
                    except ApiError as exc:
                        raise SystemExit(f"/v1/completions failed: {exc}") from exc
                    texts.append(str(reply["choices"][0]["text"]))
    units = [tuple(s["units"]) for s in manifest["segments"]]
    return texts, {"placements": version["segments"], "units": units, "card": version["card"]}


def chained(
    gguf: Path, units: list[tuple[int, int]], ids: list[int], level: int = ACCURACY_LEVEL
) -> tuple[Scores, np.ndarray]:
    """The deployed stages rebuilt with a full-vocabulary head (``MatMulNBits`` accuracy
    ``level``; the deploy's is 4: int8 activations) and run chained here; the scores and the
    full logits of every position."""
    import onnxruntime as ort

    from partitioner.models.gguf.builder import GgufSource, write_segment
    from partitioner.models.gguf.units import segment_range

    source = GgufSource(gguf)
    n = len(ids)
    pool: dict[str, np.ndarray] = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, n), np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None],
    }
    options = ort.SessionOptions()
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="gguf-agreement-") as tmp:
        for k, (a, b) in enumerate(units):
            path = Path(tmp) / f"seg{k}.onnx"
            span = segment_range(source.model, a, b)
            write_segment(
                path, source, span, top_k=source.model.vocab, trailing=n, accuracy_level=level
            )
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            for i in session.get_inputs():
                if i.name.startswith("past."):
                    pool[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
            outs = session.run(None, {i.name: pool[i.name] for i in session.get_inputs()})
            pool |= dict(zip([o.name for o in session.get_outputs()], outs, strict=True))
            del session
    logits = pool["trailing_top_logits"][0]  # [n, vocab], sorted
    order = pool["trailing_top_ids"][0]
    top = order[:, 0]
    best = logits[:, :1].astype(np.float64)
    norm = best[:, 0] + np.log(np.exp(logits - best).sum(-1))
    logprob = []
    for i in range(n - 1):
        where = int(np.flatnonzero(order[i] == ids[i + 1])[0])
        logprob.append(float(logits[i, where] - norm[i]))
    full = np.empty_like(logits)
    np.put_along_axis(full, order, logits, axis=-1)
    return Scores([int(t) for t in top[: n - 1]], logprob), full[: n - 1]


def agreement(a: list[int], b: list[int], start: int = 0) -> float:
    """Share of positions ``start..`` where the two top-1s are the same token."""
    return float(np.mean(np.array(a[start:]) == np.array(b[start:])))


def gaps(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Largest ``|logit difference|`` at position 0 and at every later position."""
    d = np.abs(a.astype(np.float64) - b)
    return float(d[0].max()), float(d[1:].max())


def near_ties(logits: np.ndarray, ours: list[int], theirs: list[int]) -> list[float]:
    """Where the two top-1s differ: how far llama.cpp's choice is below ours in our logits."""
    return [
        float(logits[i, a] - logits[i, b])
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
        if a != b
    ]


def main() -> None:
    """Run both, compare, print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "fedshard")
    parser.add_argument("--keep", type=Path, help="keep the processes' state and logs here")
    args = parser.parse_args()
    console = Console()
    gguf = packaged_gguf(MODEL, args.cache_dir)
    one_pass = llama_cpp(gguf, args.tokens, args.threads, batch_size=512)
    single = llama_cpp(gguf, args.tokens, args.threads, batch_size=1)
    ids, reference = one_pass.ids, one_pass.scores
    console.print(f"llama.cpp: {len(ids)} tokens, perplexity {reference.perplexity():.3f}")
    texts, deployed = served(console, gguf, ids, args.keep)
    local, logits = chained(gguf, deployed["units"], ids)
    exact, exact_logits = chained(gguf, deployed["units"], ids, level=0)
    with console.status("position 0 by the numpy reference (float64, then Q8_K inputs)..."):
        ref0, ref0_q8k = position_zero(gguf, ids[0])
    stored = stored_bytes(gguf)
    refs = {"one pass": one_pass, "batch 1": single}
    expected = {k: token_texts(gguf, r.scores.top) for k, r in refs.items()}
    served_top1 = {
        k: float(np.mean([a == b for a, b in zip(texts, e, strict=True)]))
        for k, e in expected.items()
    }
    served_top1_rest = float(
        np.mean([a == b for a, b in zip(texts[1:], expected["one pass"][1:], strict=True)])
    )
    header = (
        "| engine | top-1 vs llama.cpp one pass | top-1 vs llama.cpp batch 1 | the same as "
        "the first, positions 1.. | perplexity | max abs logit gap to llama.cpp one pass: "
        "position 0 / the rest |"
    )

    def row(name: str, top: list[int], ppl: str, full: np.ndarray | None) -> str:
        gap = "-" if full is None else "{:.2f} / {:.2f}".format(*gaps(full, one_pass.logits))
        return (
            f"| {name} | {agreement(top, reference.top):.3f} | "
            f"{agreement(top, single.scores.top):.3f} | "
            f"{agreement(top, reference.top, 1):.3f} | {ppl} | {gap} |"
        )

    def p0(name: str, values: np.ndarray) -> str:
        d_one = float(np.abs(values - one_pass.logits[0]).max())
        d_single = float(np.abs(values - single.logits[0]).max())
        d_ref = float(np.abs(values - ref0).max())
        return f"| {name} | {int(np.argmax(values))} | {d_ref:.2f} | {d_one:.2f} | {d_single:.2f} |"

    ties = near_ties(logits, local.top, reference.top)
    lines = [
        "# Qwen2.5-Coder-1.5B (packaged Q4_K_M GGUF): fedshard `--weights keep` vs llama.cpp",
        "",
        f"Measured {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC at commit {commit(REPO)}.",
        "",
        f"`.venv/bin/python bench/gguf_agreement.py --tokens {args.tokens} --threads "
        f"{args.threads}`: a fixed English "
        f"passage, {len(ids)} tokens (llama.cpp's tokenization of the file), teacher-forced. "
        f"File {gguf.stat().st_size / MB:,.0f} MB; stored as served (keep) {stored / MB:,.0f} "
        f"MB; {AGENTS} agents of {MEMORY}, planning caps "
        f"{min(gguf_caps(gguf, ['x'], parse_size(MEMORY)).values()) / MB:,.0f} MB each "
        "(45 % of the stored weights). llama.cpp: node-llama-cpp's prebuilt CPU binary, "
        f"{args.threads} thread(s), one process ({one_pass.resident_bytes / MB:,.0f} MB "
        "resident), scoring the text in one pass (batch 512) and one token at a time (batch 1).",
        "",
        header,
        "|---|---|---|---|---|---|",
        row(
            "llama.cpp, one pass (batch 512)",
            reference.top,
            f"{reference.perplexity():.3f}",
            one_pass.logits,
        ),
        row(
            "llama.cpp, one token at a time (batch 1)",
            single.scores.top,
            f"{single.scores.perplexity():.3f}",
            single.logits,
        ),
        f"| fedshard, {len(deployed['placements'])} agents (/v1/completions, one greedy token "
        f"per prefix) | {served_top1['one pass']:.3f} | {served_top1['batch 1']:.3f} | "
        f"{served_top1_rest:.3f} | - | - |",
        row(
            f"the same stages chained here, full-vocabulary head (accuracy level "
            f"{ACCURACY_LEVEL}, as served)",
            local.top,
            f"{local.perplexity():.3f}",
            logits,
        ),
        row(
            "the same, accuracy level 0 (float activations)",
            exact.top,
            f"{exact.perplexity():.3f}",
            exact_logits,
        ),
        "",
        "Position 0 (the first token alone; the next token predicted from one token):",
        "",
        "| logits after position 0 | top-1 id | max abs gap to the numpy reference (float64) | "
        "to llama.cpp one pass | to llama.cpp batch 1 |",
        "|---|---|---|---|---|",
        p0("numpy reference, float64", ref0),
        p0("numpy reference, every product's input rounded as llama.cpp's Q8_K", ref0_q8k),
        p0(f"fedshard chained, accuracy level {ACCURACY_LEVEL}", logits[0]),
        p0("fedshard chained, accuracy level 0", exact_logits[0]),
        p0("llama.cpp one pass", one_pass.logits[0]),
        p0("llama.cpp batch 1", single.logits[0]),
        "",
        f"Where the served top-1 differs from llama.cpp's one pass ({len(ties)} of "
        f"{len(local.top)}), llama.cpp's choice is this far below ours in our logits: "
        + (", ".join(f"{g:.2f}" for g in sorted(ties)) or "-")
        + ".",
        "",
        "| stage | device | units | predicted MB | measured MB | share of stored weights |",
        "|---|---|---|---|---|---|",
    ]
    for p, (a, b) in zip(deployed["placements"], deployed["units"], strict=True):
        predicted = p["predicted_memory_bytes"] - int(p.get("state_bytes", 0))
        lines.append(
            f"| {p['index']} | {p['device']} | {a}-{b - 1} | {predicted / MB:,.0f} | "
            f"{p['measured_memory_bytes'] / MB:,.0f} | {p['param_bytes'] / stored:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    console.print(text, highlight=False)
    RESULTS.write_text(text)
    write_headlines(
        RESULTS.stem,
        [
            Headline(
                "keep, agents: top-1 agreement with llama.cpp (one pass)",
                served_top1["one pass"],
                "",
                ">= 0.95",
            ),
            Headline(
                "keep, agents: top-1 agreement with llama.cpp (batch 1)",
                served_top1["batch 1"],
                "",
                ">= 0.95",
            ),
            Headline(
                "llama.cpp batch 1 vs its own one pass: top-1 agreement (noise floor)",
                agreement(single.scores.top, reference.top),
            ),
            Headline(
                "keep, agents: perplexity / llama.cpp one pass",
                local.perplexity() / reference.perplexity(),
                "x",
            ),
        ],
        RESULTS.parent,
    )


if __name__ == "__main__":
    main()
