"""Generation speed: agents vs the whole model in one ONNX Runtime session vs transformers
vs llama.cpp.

Same prompt (a chat message rendered with the model's own template), same number of new tokens,
greedy, one intra-op thread per stage and per session unless told (``--agent-threads``; a
draft model runs on the coordinator's ``--draft-threads``, by default half the machine's cores,
at most 4), in one run:

- fedshard: a coordinator and three (``--agents``) agents on 127.0.0.1 (planning caps, or the
  agents' own ``--memory`` budgets with ``--no-caps``, force the split), streamed
  ``/v1/chat/completions``: time to first token (the prefill) and decode tokens/s for one
  stream, then 4 concurrent streams (total tokens/s); resident memory per device, predicted by
  the plan and measured by the agent;
- ONNX Runtime: the exported model in one session, its own KV cache (``OrtDecoder``);
- transformers: ``generate`` on the same float32 weights in torch (``--no-transformers`` skips);
- llama.cpp (``--llama-cpp``): the model's own GGUF file in one process (node-llama-cpp's prebuilt
  CPU binary, ``make bench-setup``);
- speculative decoding (prompt lookup, and with ``--draft-model`` a draft model on the
  coordinator: its draft-only export, ``fedshard export --draft``, and with ``--whole-head``
  also its plain int4 export) against none, on the same agents (exports with trailing top-k
  outputs only): a code-editing prompt (the answer repeats the code) and free chat, one stream
  and four, with the acceptance rate; the greedy text with and without speculation is asserted
  equal.

    .venv/bin/python bench/generate.py [--model gemma3-270m] [--tokens 64] [--runs 2]
    .venv/bin/python bench/generate.py --model qwen2.5-coder-1.5b --weights int4 --agents 4 \
        --memory 512MiB --no-caps --no-transformers --llama-cpp --tokens 32 --runs 1 \
        --out bench/results/generate_qwen.md
    .venv/bin/python bench/generate.py --model qwen2.5-coder-1.5b --weights int4 \
        --draft-model qwen2.5-coder-0.5b --whole-head --no-transformers --tokens 64 --runs 2 \
        --prompt "free chat" --out bench/results/generate_qwen_draft_chat.md

Prints a table and writes bench/results/generate.md (+ generate.json). Targets: one stream at
least 0.9x the single-session ONNX Runtime decode speed; 4 streams at least 1.8x one stream's
total tokens/s; prompt lookup at least 1.5x on the editing prompt; the draft model at least
1.3x on free chat.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from coordinator.commands import default_draft_threads  # noqa: E402
from coordinator.generation.tuning import acceptance_rate  # noqa: E402
from devtools.demo.decoder import (  # noqa: E402
    decoder_caps,
    decoder_info,
    deploy_decoder,
    export_decoder,
)
from devtools.demo.procs import demo_processes, free_port  # noqa: E402
from devtools.demo.steps import Api, pair_automatically  # noqa: E402
from protocols.sizes import parse_size  # noqa: E402

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
TARGET_VS_ORT = 0.9
TARGET_STREAMS = 1.8


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
    start = time.perf_counter()
    first = last = 0.0
    count = 0
    pieces: list[str] = []
    for chunk in api.client(timeout=600).stream("/v1/chat/completions", body):
        if chunk.usage:
            count = int(chunk.usage["completion_tokens"])
        if piece := chunk.text():
            pieces.append(piece)
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
    """The median of ``one_runs``."""
    one_runs: tuple[float, ...]
    """Each one-stream run's decode tokens/s, in order."""
    four_tps: float
    acceptance: float | None
    text: str


def speculative_rows(
    api: Api,
    model_id: str,
    tokens: int,
    runs: int,
    drafts: dict[str, Path] | None = None,
    prompts: tuple[str, ...] = tuple(PROMPTS),
) -> list[SpecRow]:
    """Each prompt without speculation, with prompt lookup and with each of ``drafts`` (draft
    model exports by mode label, see :data:`DRAFTERS`), side by side on one chain; the greedy
    texts must be equal (one stream, four streams, every mode).

    The one-stream runs go round the modes ``runs`` times, each round starting one mode later,
    so every mode's runs sit next to the others' in time and a machine that drifts during the
    benchmark moves them alike; then each mode's four streams."""
    drafts = drafts or {}
    modes = ("off", "lookup", *drafts)
    rows = []
    for label in prompts:
        question = PROMPTS[label]
        single: dict[str, list[Run]] = {mode: [] for mode in modes}
        counts = dict.fromkeys(modes, (0, 0))
        for round_ in range(runs):
            turn = round_ % len(modes)
            for mode in modes[turn:] + modes[:turn]:
                _set_speculative(api, model_id, mode, drafts)
                with _counting(api, model_id, counts, mode):
                    single[mode].append(stream_chat(api, model_id, tokens, question))
        for mode in modes:
            _set_speculative(api, model_id, mode, drafts)
            with _counting(api, model_id, counts, mode):
                four, streams = concurrent_runs(api, model_id, tokens, 4, question)
            texts = {r.text for r in [*single[mode], *streams]}
            if len(texts) != 1:
                raise AssertionError(f"{label}, {mode}: greedy streams differ: {texts}")
            drafted, accepted = counts[mode]
            one_runs = tuple(r.decode_tps for r in single[mode])
            rate = acceptance_rate(drafted, accepted)
            one = statistics.median(one_runs)
            rows.append(SpecRow(label, mode, one, one_runs, four, rate, texts.pop()))
        if len({row.text for row in rows[-len(modes) :]}) != 1:
            raise AssertionError(f"{label}: speculation changed the greedy text")
    return rows


def _set_speculative(api: Api, model_id: str, mode: str, drafts: dict[str, Path]) -> None:
    """Switch the deployment to ``mode`` (a key of ``drafts`` means that draft model)."""
    draft = str(drafts[mode]) if mode in drafts else None
    api.client().set_speculative(model_id, mode if draft is None else "draft", draft)


@contextlib.contextmanager
def _counting(
    api: Api, model_id: str, counts: dict[str, tuple[int, int]], mode: str
) -> Iterator[None]:
    """Add the drafted and accepted tokens of the block's generations to ``counts[mode]``."""
    before = _counts(api, model_id)
    yield
    after = _counts(api, model_id)
    drafted, accepted = counts[mode]
    counts[mode] = (drafted + after[0] - before[0], accepted + after[1] - before[1])


def _counts(api: Api, model_id: str) -> tuple[int, int]:
    """The model's drafted and accepted token counters from the console API."""
    [model] = [m for m in api.client().console_models() if m.model_id == model_id]
    return model.drafted_tokens, model.accepted_tokens


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

    from partitioner.models.decoders.progress import Steps
    from partitioner.models.decoders.sources import load_source

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


@dataclass(frozen=True)
class Fleet:
    """The agents the model is deployed on, and the coordinator's drafting threads."""

    agents: int
    memory: str
    """Each agent's memory budget (``--memory``)."""
    caps: bool
    """Plan under :func:`decoder_caps` (else only under the agents' own budgets)."""
    draft_threads: int
    """The coordinator's ``--draft-threads``."""
    agent_threads: int = 1
    """Each agent's ``--threads`` (ONNX Runtime intra-op threads), and the whole-model
    session's."""


def fedshard_runs(
    console: Console,
    name: str,
    export: Path,
    ids: list[int],
    tokens: int,
    runs: int,
    fleet: Fleet,
    drafts: dict[str, Path] | None = None,
    prompts: tuple[str, ...] = tuple(PROMPTS),
) -> tuple[list[Run], list[Run], float, Run, list[dict[str, Any]], list[SpecRow]]:
    """Deploy across the agents; one-stream runs without speculation, each followed by a run
    of the whole model in one ONNX Runtime session (so both see the same machine), then four
    concurrent streams; then the speculative comparison (:func:`speculative_rows`) when the
    export has trailing top-k outputs. Also returns the deployment's placements (predicted
    and measured memory per device)."""
    from partitioner.models.decoders.ort_runner import OrtDecoder

    decoder = OrtDecoder(export, threads=fleet.agent_threads)
    model_id = name
    with tempfile.TemporaryDirectory(prefix="fedshard-bench-gen-") as tmp:
        work = Path(tmp)
        with demo_processes(work) as procs:
            coordinator = procs.start_coordinator(
                work / "coordinator",
                free_port(),
                options=["--draft-threads", str(fleet.draft_threads)],
            )
            suffix = secrets.token_hex(2)
            names = [f"gen{i}-{suffix}" for i in range(fleet.agents)]
            first = None
            state_dirs = {}
            for agent in names:
                child = procs.start_agent(
                    agent,
                    fleet.memory,
                    work / agent,
                    profile_from=first,
                    threads=fleet.agent_threads,
                )
                first = first or child.state_dir / "profile.json"
                state_dirs[agent] = child.state_dir
            api = Api(coordinator.url, coordinator.token)
            pair_automatically(console, api, state_dirs, procs.check_alive)
            caps = decoder_caps(export, names, parse_size(fleet.memory)) if fleet.caps else {}
            placements = deploy_decoder(console, api, export, model_id, caps)["segments"]
            api.client().set_speculative(model_id, "off")
            stream_chat(api, model_id, 4)  # warm the connections
            ort_run(decoder, ids, 4)
            single: list[Run] = []
            whole: list[Run] = []
            for _ in range(runs):
                single.append(stream_chat(api, model_id, tokens))
                whole.append(ort_run(decoder, ids, tokens))
            total_tps, slowest = concurrent_streams(api, model_id, tokens, 4)
            spec: list[SpecRow] = []
            if decoder_info(export).trailing_positions is not None:
                with console.status("speculative decoding: off vs prompt lookup (vs draft)"):
                    spec = speculative_rows(api, model_id, tokens, runs, drafts, prompts)
    return single, whole, total_tps, slowest, list(placements), spec


def prepared_export(console: Console, name: str, weights: str) -> Path:
    """The model's export in ``weights`` under the cache (``fedshard export --weights``, once)."""
    if weights == "fp32":
        return export_decoder(console, name, CACHE / "exports" / name, CACHE)
    from partitioner.models.decoders.precision import current_export, parse_weights

    out = CACHE / "exports" / f"{name}-{weights}"
    if not current_export(out, parse_weights(weights)):  # missing, or an older scheme's
        from partitioner.models.decoders.progress import RichSteps
        from partitioner.models.frontdoor import export_decoder as export_weights

        steps = RichSteps(console)
        export_weights(name, out, cache_dir=CACHE, weights=parse_weights(weights), steps=steps)
    return out


DRAFTERS = {
    "lookup": "prompt lookup",
    "draft": "draft model",
    "draft, whole head": "draft model with its whole head",
}
"""Speculative modes by label: ``draft`` is a draft-only export (``fedshard export --draft``),
``draft, whole head`` the same model's plain int4 export."""


def draft_exports(console: Console, name: str, whole_head: bool) -> dict[str, Path]:
    """The draft models to compare, by mode label: ``name`` itself (an export directory), or
    decoder ``name``'s cached draft-only export and, with ``whole_head``, its int4 export."""
    from partitioner.models.decoders.precision import default_weights

    path = Path(name)
    if (path / "decoder.json").is_file():
        return {"draft": path.resolve()}
    drafts = {"draft": lean_draft_export(console, name)}
    if whole_head:
        drafts["draft, whole head"] = prepared_export(console, name, default_weights(name))
    return drafts


def lean_draft_export(console: Console, name: str) -> Path:
    """Decoder ``name``'s draft-only export under the cache (``fedshard export --draft``, again
    whenever the cached one is not :func:`current_draft_export`)."""
    from partitioner.models.decoders.draft_head import current_draft_export
    from partitioner.models.decoders.progress import RichSteps
    from partitioner.models.decoders.weights import DRAFT_VOCABULARY
    from partitioner.models.frontdoor import export_decoder as export_model

    out = CACHE / "exports" / f"{name}-draft"
    if not current_draft_export(out, DRAFT_VOCABULARY):
        export_model(
            name, out, cache_dir=CACHE, steps=RichSteps(console), draft_vocabulary=DRAFT_VOCABULARY
        )
    return out


def gguf_file(name: str) -> Path:
    """The GGUF file the model's weights come from (assembled from its packages once)."""
    from partitioner.models.decoders import qwen
    from partitioner.models.decoders.progress import Steps

    if name != qwen.NAME:
        raise SystemExit(f"--llama-cpp: no GGUF file known for {name}")
    return qwen.gguf_path(CACHE, Steps())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--weights", default="fp32", help="fp32, fp16, int8 or int4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--memory", default="4GiB", help="each agent's memory budget")
    parser.add_argument("--no-caps", action="store_true", help="plan under the budgets only")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--llama-cpp", action="store_true", help="also llama.cpp on the GGUF")
    parser.add_argument("--out", type=Path, default=RESULTS / "generate.md")
    parser.add_argument("--export", type=Path, help="an export with trailing top-k outputs")
    parser.add_argument(
        "--draft-model",
        help="also speculate with this draft model: an export directory or a decoder name "
        "(its draft-only export, made once)",
    )
    parser.add_argument(
        "--whole-head",
        action="store_true",
        help="with a decoder name for --draft-model: also speculate with its plain int4 export "
        "(the whole output head), side by side",
    )
    parser.add_argument(
        "--draft-threads",
        type=int,
        default=default_draft_threads(),
        help="the coordinator's threads for a draft model (default: its own default, %(default)s)",
    )
    parser.add_argument(
        "--agent-threads",
        type=int,
        default=1,
        help="each agent's ONNX Runtime intra-op threads, and the whole-model session's "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        choices=list(PROMPTS),
        help="speculate on this prompt only (repeatable; default: every prompt)",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    console = Console()
    export = args.export or prepared_export(console, args.model, args.weights)
    drafts = draft_exports(console, args.draft_model, args.whole_head) if args.draft_model else {}
    ids = prompt_ids(export)
    fleet = Fleet(
        args.agents, args.memory, not args.no_caps, args.draft_threads, args.agent_threads
    )
    single, whole, total_tps, slowest, placements, spec = fedshard_runs(
        console,
        args.model,
        export,
        ids,
        args.tokens,
        args.runs,
        fleet,
        drafts,
        tuple(args.prompt or PROMPTS),
    )
    one = statistics.median(r.decode_tps for r in single)
    ort_tps = statistics.median(r.decode_tps for r in whole)
    ttft = statistics.median(r.ttft_s for r in single)
    one_total = statistics.median(r.tokens / r.wall_s for r in single)
    agents = f"{len({p['device'] for p in placements})} agents"
    rows = [
        (f"fedshard, {agents}, 1 stream", ttft, one, one_total),
        (f"fedshard, {agents}, 4 streams", slowest.ttft_s, slowest.decode_tps, total_tps),
        (
            "ONNX Runtime, whole model, 1 session",
            statistics.median(r.ttft_s for r in whole),
            ort_tps,
            statistics.median(r.tokens / r.wall_s for r in whole),
        ),
    ]
    if not args.no_transformers:
        hf = transformers_run(args.model, ids, args.tokens)
        rows.append(("transformers generate", hf.ttft_s, hf.decode_tps, hf.tokens / hf.wall_s))
    notes: list[str] = []
    ratios = {"vs_ort": one / ort_tps, "streams": total_tps / one_total}
    if args.llama_cpp:
        from _llama_cpp import llama_cpp_run

        llama = llama_cpp_run(gguf_file(args.model), ids, args.tokens)
        if isinstance(llama, str):
            notes.append(f"llama.cpp did not run: {llama}")
        else:
            rows.append(
                (
                    "llama.cpp, GGUF, 1 process",
                    llama.ttft_s,
                    llama.decode_tps,
                    llama.tokens / llama.wall_s,
                )
            )
            ratios["vs_llama"] = one / llama.decode_tps
            ratios["prefill_vs_llama"] = ttft / llama.ttft_s
            notes.append(
                f"llama.cpp process resident memory: {llama.resident_bytes / 2**20:.0f} MiB"
            )
    report(console, args, ids, rows, ratios, placements, notes, spec)
    return 0


def report(
    console: Console,
    args: argparse.Namespace,
    ids: list[int],
    rows: list[tuple[str, float, float, float]],
    ratios: dict[str, float],
    placements: list[dict[str, Any]],
    notes: list[str],
    spec: list[SpecRow],
) -> None:
    """Print the tables and write the markdown and JSON results."""
    title = f"{args.model} ({args.weights}): {len(ids)}-token prompt, {args.tokens} new tokens"
    table = Table(title=f"{title}, greedy")
    columns = ("engine", "time to first token (prefill)", "decode tokens/s", "total tokens/s")
    for column in columns:
        table.add_column(column)
    for name, ttft, decode, total in rows:
        table.add_row(name, f"{ttft * 1e3:.0f} ms", f"{decode:.1f}", f"{total:.1f}")
    console.print(table)
    command = " ".join(sys.argv[1:])
    lines = [
        f"# Generation speed ({args.model}, {args.weights})",
        "",
        f"`.venv/bin/python bench/generate.py {command}` on {os.cpu_count()} cores; "
        f"{args.agent_threads} intra-op thread(s) per stage and per session (a draft model: "
        f"the coordinator's "
        f"`--draft-threads`, {args.draft_threads}); {len(ids)}-token chat prompt, "
        f"{args.tokens} new tokens, greedy; agents of {args.memory} each.",
        "",
        "| engine | time to first token (prefill) | decode tokens/s | total tokens/s |",
        "|---|---|---|---|",
        *(f"| {n} | {t * 1e3:.0f} ms | {d:.1f} | {w:.1f} |" for n, t, d, w in rows),
        "",
        "| stage | device | weights MiB | predicted resident MiB | measured resident MiB | "
        "measured / predicted |",
        "|---|---|---|---|---|---|",
        *(_memory_row(p) for p in sorted(placements, key=lambda p: p["index"])),
        "",
        f"- one stream vs one ONNX Runtime session (decode): **{ratios['vs_ort']:.2f}x** "
        f"(target >= {TARGET_VS_ORT}x)",
        f"- 4 streams vs one stream (total tokens/s): **{ratios['streams']:.2f}x** "
        f"(target >= {TARGET_STREAMS}x)",
        "",
        *(speculative_lines(console, spec) if spec else []),
    ]
    if "vs_llama" in ratios:
        lines.append(
            f"- one stream vs llama.cpp (decode): **{ratios['vs_llama']:.2f}x**; "
            f"prefill time vs llama.cpp: **{ratios['prefill_vs_llama']:.2f}x**"
        )
    lines += [f"- {note}" for note in notes] + [""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    label = f"generation ({args.model}, {args.weights})"
    headlines = [
        {
            "name": f"{label}: 1 stream vs ORT session",
            "value": ratios["vs_ort"],
            "target": TARGET_VS_ORT,
        },
        {
            "name": f"{label}: 4 streams vs 1 stream",
            "value": ratios["streams"],
            "target": TARGET_STREAMS,
        },
    ]
    if "vs_llama" in ratios:
        headlines.append({"name": f"{label}: 1 stream vs llama.cpp", "value": ratios["vs_llama"]})
    for (prompt, mode, streams), value in spec_speedups(spec).items():
        headline: dict[str, Any] = {
            "name": f"{label}: {DRAFTERS[mode]} vs none, {prompt}, {STREAMS[streams]}",
            "value": value,
        }
        target = {("lookup", "code editing"): 1.5, ("draft", "free chat"): 1.3}.get((mode, prompt))
        if target is not None and streams == "one":
            headline["target"] = target
        headlines.append(headline)
    args.out.with_suffix(".json").write_text(json.dumps({"headlines": headlines}, indent=2) + "\n")
    console.print("\n".join(lines[-len(notes) - 4 :]))


def _memory_row(p: dict[str, Any]) -> str:
    mib = 2**20
    ratio = p["measured_memory_bytes"] / max(1, p["predicted_memory_bytes"])
    return (
        f"| {p['index']} | {p['device']} | {p['param_bytes'] / mib:.0f} | "
        f"{p['predicted_memory_bytes'] / mib:.0f} | {p['measured_memory_bytes'] / mib:.0f} | "
        f"{ratio:.2f}x |"
    )


STREAMS = {"one": "1 stream", "four": "4 streams"}


def spec_speedups(spec: list[SpecRow]) -> dict[tuple[str, str, str], float]:
    """Each mode over no speculation, by prompt, mode and ``one`` / ``four`` streams; one
    stream's is the median over rounds of each run over the same round's run without."""
    off = {row.prompt: row for row in spec if row.mode == "off"}
    out = {}
    for row in spec:
        if row.mode != "off":
            base = off[row.prompt]
            paired = [a / b for a, b in zip(row.one_runs, base.one_runs, strict=True)]
            out[(row.prompt, row.mode, "one")] = statistics.median(paired)
            out[(row.prompt, row.mode, "four")] = row.four_tps / base.four_tps
    return out


def speculative_lines(console: Console, spec: list[SpecRow]) -> list[str]:
    """The speculative table (printed) as markdown lines."""
    table = Table(title="speculative decoding, 3 agents: greedy text identical in every row pair")
    heads = (
        "prompt",
        "speculative",
        "1 stream decode tokens/s (each run)",
        "4 streams total tokens/s",
    )
    for column in (*heads, "accepted drafts", "speedup 1 / 4 streams"):
        table.add_column(column)
    speedups = spec_speedups(spec)
    lines = [
        "## Speculative decoding (same chain, same prompts, greedy text asserted equal)",
        "",
        "One-stream runs go round the modes (each round one mode later); a speedup for one "
        "stream is the median of each round's run over the same round's run without "
        "speculation. Four streams run after the rounds.",
        "",
        f"| {' | '.join(heads)} | accepted drafts | speedup 1 / 4 streams |",
        "|---|---|---|---|---|---|",
    ]
    for row in spec:
        rate = "–" if row.acceptance is None else f"{row.acceptance:.0%}"
        gain = (
            f"{speedups[(row.prompt, row.mode, 'one')]:.2f}x / "
            f"{speedups[(row.prompt, row.mode, 'four')]:.2f}x"
            if row.mode != "off"
            else "–"
        )
        each = ", ".join(f"{tps:.1f}" for tps in row.one_runs)
        one = f"{row.one_tps:.1f} ({each})" if len(row.one_runs) > 1 else f"{row.one_tps:.1f}"
        cells = (row.prompt, row.mode, one, f"{row.four_tps:.1f}", rate, gain)
        table.add_row(*cells)
        lines.append(f"| {' | '.join(cells)} |")
    console.print(table)
    return [*lines, ""]


if __name__ == "__main__":
    sys.exit(main())
