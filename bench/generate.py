"""Generation speed: three agents vs the whole model in one ONNX Runtime session vs transformers.

Same prompt (a chat message rendered with the model's own template), same number of new tokens,
greedy, one intra-op thread everywhere (the agents' default), in one run:

- fedshard: a coordinator and three agents on 127.0.0.1 (planning caps force three segments),
  streamed ``/v1/chat/completions``: time to first token and decode tokens/s for one stream,
  then 4 concurrent streams (total tokens/s);
- ONNX Runtime: the exported model in one session, its own KV cache (``OrtDecoder``);
- transformers: ``generate`` on the same weights in torch;
- speculative decoding (prompt lookup) against none, on the same three agents: a code-editing
  prompt (the answer repeats the code) and free chat, one stream and four, with the acceptance
  rate; the greedy text with and without speculation is asserted equal.

    .venv/bin/python bench/generate.py [--model gemma3-270m] [--tokens 64] [--runs 2]
        [--export DIR]

Prints tables and writes bench/results/generate.md (+ generate.json). Targets: one stream at
least 0.7x the single-session ONNX Runtime decode speed; 4 streams at least 1.8x one stream's
total tokens/s; prompt lookup at least 1.5x on the editing prompt.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from devtools.demo.decoder import (  # noqa: E402
    decoder_caps,
    decoder_info,
    deploy_decoder,
    export_decoder,
)
from devtools.demo.procs import demo_processes, free_port  # noqa: E402
from devtools.demo.steps import Api, pair_automatically  # noqa: E402

QUESTION = "Explain in a few sentences why splitting a model across several devices helps."
EDIT_PROMPT = (
    "Rename the function `area` to `rectangle_area` in this code and change nothing else:\n\n"
    "```python\n"
    "def area(width, height):\n"
    '    """The area of a rectangle."""\n'
    "    return width * height\n\n\n"
    "def total_area(rectangles):\n"
    "    total = 0\n"
    "    for width, height in rectangles:\n"
    "        total += area(width, height)\n"
    "    return total\n"
    "```"
)
PROMPTS = {"code editing": EDIT_PROMPT, "free chat": QUESTION}
CACHE = REPO / ".cache" / "fedshard"
RESULTS = REPO / "bench" / "results"


@dataclass(frozen=True)
class Run:
    """One generation: time to first token, tokens generated, decode tokens per second."""

    ttft_s: float
    tokens: int
    decode_tps: float
    wall_s: float
    text: str = ""


def stream_chat(api: Api, model_id: str, tokens: int, question: str = QUESTION) -> Run:
    """One streamed greedy chat completion through the coordinator."""
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api.token}"}
    start = time.perf_counter()
    first = last = 0.0
    count = 0
    pieces: list[str] = []
    with (
        httpx.Client(base_url=api.url, timeout=600, trust_env=False) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply,
    ):
        if reply.status_code != 200:
            raise RuntimeError(f"chat completion failed: {reply.status_code} {reply.read()!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                count = int(chunk["usage"]["completion_tokens"])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                pieces.append(chunk["choices"][0]["delta"]["content"])
                now = time.perf_counter()
                first = first or now
                last = now
    wall = time.perf_counter() - start
    decode = (count - 1) / (last - first) if count > 1 and last > first else 0.0
    return Run(first - start, count, decode, wall, "".join(pieces))


def concurrent_runs(
    api: Api, model_id: str, tokens: int, streams: int, question: str = QUESTION
) -> tuple[float, list[Run]]:
    """``streams`` generations at once: total tokens/s and every stream's run."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        runs = list(
            pool.map(lambda _: stream_chat(api, model_id, tokens, question), range(streams))
        )
    wall = time.perf_counter() - start
    return sum(r.tokens for r in runs) / wall, runs


def concurrent_streams(api: Api, model_id: str, tokens: int, streams: int) -> tuple[float, Run]:
    """``streams`` generations at once: total tokens/s and the slowest stream's numbers."""
    total, runs = concurrent_runs(api, model_id, tokens, streams)
    return total, max(runs, key=lambda r: r.wall_s)


@dataclass(frozen=True)
class SpecRow:
    """One prompt under one speculative mode: tokens/s for 1 and 4 streams, acceptance."""

    prompt: str
    mode: str
    one_tps: float
    four_tps: float
    acceptance: float | None
    text: str


def speculative_rows(api: Api, model_id: str, tokens: int, runs: int) -> list[SpecRow]:
    """Each prompt without speculation and with prompt lookup, side by side on one chain; the
    greedy texts must be equal (one stream, four streams, both modes)."""
    rows = []
    for label, question in PROMPTS.items():
        for mode in ("off", "lookup"):
            code, reply = api.call(
                "PUT", f"/v1/deployments/{model_id}/speculative", {"speculative": mode}
            )
            if code != 200:
                raise RuntimeError(f"cannot set speculative={mode}: {code} {reply}")
            before = _counts(api, model_id)
            single = [stream_chat(api, model_id, tokens, question) for _ in range(runs)]
            four, streams = concurrent_runs(api, model_id, tokens, 4, question)
            drafted, accepted = (a - b for a, b in zip(_counts(api, model_id), before, strict=True))
            texts = {r.text for r in [*single, *streams]}
            if len(texts) != 1:
                raise AssertionError(f"{label}, {mode}: greedy streams differ: {texts}")
            one = statistics.median(r.decode_tps for r in single)
            rate = accepted / drafted if drafted else None
            rows.append(SpecRow(label, mode, one, four, rate, texts.pop()))
        if rows[-1].text != rows[-2].text:
            raise AssertionError(f"{label}: speculation changed the greedy text")
    return rows


def _counts(api: Api, model_id: str) -> tuple[int, int]:
    """The model's drafted and accepted token counters from the console API."""
    code, reply = api.call("GET", "/v1/console/models", None)
    if code != 200:
        raise RuntimeError(f"console models: {code}")
    [model] = [m for m in reply if m["model_id"] == model_id]
    return int(model["drafted_tokens"]), int(model["accepted_tokens"])


def prompt_ids(export: Path) -> list[int]:
    """The chat prompt's token ids exactly as the coordinator renders them."""
    from coordinator.generation.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer.from_file(export, decoder_info(export))
    return tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": QUESTION}]))


def ort_run(decoder: Any, ids: list[int], tokens: int) -> Run:
    """The whole model in one ONNX Runtime session (an ``OrtDecoder``, one intra-op thread)."""
    start = time.perf_counter()
    result = decoder.prefill(ids)
    ttft = time.perf_counter() - start
    token = result.token
    decode_start = time.perf_counter()
    for _ in range(tokens - 1):
        token = decoder.decode(token).token
    decode = time.perf_counter() - decode_start
    return Run(ttft, tokens, (tokens - 1) / decode, time.perf_counter() - start)


def transformers_run(name: str, ids: list[int], tokens: int) -> Run:
    """transformers' ``generate`` on the same weights (torch, one thread)."""
    import torch

    from partitioner.decoders.progress import Steps
    from partitioner.decoders.sources import load_source

    torch.set_num_threads(1)
    model = load_source(name, CACHE, Steps()).model
    prompt = torch.tensor([ids], dtype=torch.int64)
    options = {"do_sample": False, "pad_token_id": model.config.pad_token_id}
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1, **options)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            **options,
        )
        wall = time.perf_counter() - start
    return Run(ttft, tokens, (tokens - 1) / max(wall - ttft, 1e-9), wall)


def fedshard_runs(
    console: Console, name: str, export: Path, ids: list[int], tokens: int, runs: int
) -> tuple[list[Run], list[Run], float, Run, list[SpecRow]]:
    """Deploy across three agents; one-stream runs without speculation, each followed by a run
    of the whole model in one ONNX Runtime session (so both see the same machine), then four
    concurrent streams; then the speculative comparison (:func:`speculative_rows`)."""
    from partitioner.decoders.ort_runner import OrtDecoder

    decoder = OrtDecoder(export, threads=1)
    model_id = name
    with tempfile.TemporaryDirectory(prefix="fedshard-bench-gen-") as tmp:
        work = Path(tmp)
        with demo_processes(work) as procs:
            coordinator = procs.start_coordinator(work / "coordinator", free_port())
            suffix = secrets.token_hex(2)
            names = [f"gen{i}-{suffix}" for i in range(3)]
            first = None
            for agent in names:
                child = procs.start_agent(agent, "4GiB", work / agent, profile_from=first)
                first = first or child.state_dir / "profile.json"
            api = Api(coordinator.url, coordinator.token)
            pair_automatically(console, api, names, procs.check_alive)
            deploy_decoder(console, api, export, model_id, decoder_caps(export, names))
            api.call("PUT", f"/v1/deployments/{model_id}/speculative", {"speculative": "off"})
            stream_chat(api, model_id, 4)  # warm the connections
            ort_run(decoder, ids, 4)
            single: list[Run] = []
            whole: list[Run] = []
            for _ in range(runs):
                single.append(stream_chat(api, model_id, tokens))
                whole.append(ort_run(decoder, ids, tokens))
            total_tps, slowest = concurrent_streams(api, model_id, tokens, 4)
            with console.status("speculative decoding: off vs prompt lookup"):
                spec = speculative_rows(api, model_id, tokens, runs)
    return single, whole, total_tps, slowest, spec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "generate.md")
    parser.add_argument("--export", type=Path, help="an export with trailing top-k outputs")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    console = Console()
    out = args.export or CACHE / "exports" / args.model
    export = export_decoder(console, args.model, out, CACHE)
    if decoder_info(export).trailing_positions is None:
        raise SystemExit(f"{export} was exported before trailing top-k outputs: re-export it")
    ids = prompt_ids(export)
    single, whole, total_tps, slowest, spec = fedshard_runs(
        console, args.model, export, ids, args.tokens, args.runs
    )
    hf = transformers_run(args.model, ids, args.tokens)
    one = statistics.median(r.decode_tps for r in single)
    ort_tps = statistics.median(r.decode_tps for r in whole)
    ttft = statistics.median(r.ttft_s for r in single)
    one_total = statistics.median(r.tokens / r.wall_s for r in single)
    rows = [
        ("fedshard, 3 agents, 1 stream", ttft, one, one_total),
        ("fedshard, 3 agents, 4 streams", slowest.ttft_s, slowest.decode_tps, total_tps),
        (
            "ONNX Runtime, whole model, 1 session",
            statistics.median(r.ttft_s for r in whole),
            ort_tps,
            statistics.median(r.tokens / r.wall_s for r in whole),
        ),
        ("transformers generate", hf.ttft_s, hf.decode_tps, hf.tokens / hf.wall_s),
    ]
    vs_ort = one / ort_tps
    streams = total_tps / one_total
    report(console, args, ids, rows, vs_ort, streams, spec)
    return 0


def report(
    console: Console,
    args: argparse.Namespace,
    ids: list[int],
    rows: list[tuple[str, float, float, float]],
    vs_ort: float,
    streams: float,
    spec: list[SpecRow],
) -> None:
    """Print the tables and write the markdown and JSON results."""
    table = Table(title=f"{args.model}: {len(ids)}-token prompt, {args.tokens} new tokens, greedy")
    for column in ("engine", "time to first token", "decode tokens/s", "total tokens/s"):
        table.add_column(column)
    for name, ttft, decode, total in rows:
        table.add_row(name, f"{ttft * 1e3:.0f} ms", f"{decode:.1f}", f"{total:.1f}")
    console.print(table)
    lines = [
        f"# Generation speed ({args.model})",
        "",
        f"`.venv/bin/python bench/generate.py --model {args.model} --tokens {args.tokens} "
        f"--runs {args.runs}{f' --export {args.export}' if args.export else ''}` on "
        f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f} at the end); one "
        f"intra-op thread everywhere; {len(ids)}-token chat prompt, {args.tokens} new tokens, "
        "greedy.",
        "",
        "| engine | time to first token | decode tokens/s | total tokens/s |",
        "|---|---|---|---|",
        *(f"| {n} | {t * 1e3:.0f} ms | {d:.1f} | {w:.1f} |" for n, t, d, w in rows),
        "",
        f"- one stream vs one ONNX Runtime session (decode): **{vs_ort:.2f}x** (target >= 0.7x)",
        f"- 4 streams vs one stream (total tokens/s): **{streams:.2f}x** (target >= 1.8x)",
        "",
        *speculative_lines(console, spec),
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    speedups = spec_speedups(spec)
    headlines = {
        "headlines": [
            {"name": "generation: 1 stream vs ORT session", "value": vs_ort, "target": 0.7},
            {"name": "generation: 4 streams vs 1 stream", "value": streams, "target": 1.8},
            {
                "name": "generation: prompt lookup vs none, code editing, 1 stream",
                "value": speedups[("code editing", "one")],
                "target": 1.5,
            },
            *(
                {"name": f"generation: prompt lookup vs none, {p}, {STREAMS[n]}", "value": v}
                for (p, n), v in speedups.items()
                if (p, n) != ("code editing", "one")
            ),
        ]
    }
    args.out.with_suffix(".json").write_text(json.dumps(headlines, indent=2) + "\n")
    console.print(f"one stream / ORT: {vs_ort:.2f}x; 4 streams / one: {streams:.2f}x")


STREAMS = {"one": "1 stream", "four": "4 streams"}


def spec_speedups(spec: list[SpecRow]) -> dict[tuple[str, str], float]:
    """Lookup over no speculation, by prompt and by ``one`` / ``four`` streams."""
    out = {}
    for off, lookup in zip(spec[0::2], spec[1::2], strict=True):
        out[(off.prompt, "one")] = lookup.one_tps / off.one_tps
        out[(off.prompt, "four")] = lookup.four_tps / off.four_tps
    return out


def speculative_lines(console: Console, spec: list[SpecRow]) -> list[str]:
    """The speculative table (printed) as markdown lines."""
    table = Table(title="speculative decoding, 3 agents: greedy text identical in every row pair")
    heads = ("prompt", "speculative", "1 stream decode tokens/s", "4 streams total tokens/s")
    for column in (*heads, "accepted drafts", "speedup 1 / 4 streams"):
        table.add_column(column)
    speedups = spec_speedups(spec)
    lines = [
        "## Speculative decoding (same chain, same prompts, greedy text asserted equal)",
        "",
        f"| {' | '.join(heads)} | accepted drafts | speedup 1 / 4 streams |",
        "|---|---|---|---|---|---|",
    ]
    for row in spec:
        rate = "–" if row.acceptance is None else f"{row.acceptance:.0%}"
        gain = (
            f"{speedups[(row.prompt, 'one')]:.2f}x / {speedups[(row.prompt, 'four')]:.2f}x"
            if row.mode != "off"
            else "–"
        )
        cells = (row.prompt, row.mode, f"{row.one_tps:.1f}", f"{row.four_tps:.1f}", rate, gain)
        table.add_row(*cells)
        lines.append(f"| {' | '.join(cells)} |")
    console.print(table)
    return [*lines, ""]


if __name__ == "__main__":
    sys.exit(main())
