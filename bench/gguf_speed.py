"""One-stream decode and prefill of the packaged GGUFs: fedshard's agents against llama.cpp on
the same file and threads, and fedshard's decode against the memory-bandwidth bound (issue 40
item 9).

Per packaged GGUF (Qwen2.5-Coder-1.5B, Qwen2.5-Coder-0.5B, Gemma 3 270M):

- llama.cpp (node-llama-cpp's prebuilt CPU binary, ``make bench-setup``), one process on
  ``--threads`` threads, run once per precision right before fedshard's measurement (the
  agents deployed and idle), so both meet the same load: a fixed prompt of ``--prompt``
  tokens (the file's own tokenizer), time to first token (prefill tokens/s = prompt / that
  time) and greedy decode tokens/s over ``--tokens`` tokens;
- fedshard, per precision (``--weights``, default ``keep`` and ``int4``): a coordinator and
  ``--agents`` agents on 127.0.0.1 (``--threads`` ONNX Runtime threads each; one stream keeps
  one agent busy at a time), the ``.gguf`` deployed with ``POST /v1/deployments`` under planning
  caps that split it over the agents; prefill = the same prompt's ids through
  ``/v1/completions`` with ``max_tokens`` 1 (best of two), decode = a streamed greedy
  completion of ``--tokens`` tokens after it;
- the bound: bytes read per decode step (the planner's unit table at the precision served:
  every weight as stored, the KV cache read at that context, the embedding's one row) divided
  by the agents' measured streaming-read GB/s (``memory_gbps`` of their profile).

Every ratio is printed, whichever way it falls; ``bench/results/gguf_speed.md`` and the
headlines ``gguf_speed.json`` (targets: decode >= 0.9x llama.cpp, prefill >= 0.7x, decode >=
0.7 of the bound) go into ``bench/report``. About 10-15 minutes on two busy cores::

    .venv/bin/python bench/gguf_speed.py [--models qwen2.5-coder-0.5b,...] [--weights keep,int4]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO), str(HERE)]

from _llama_cpp import LlamaRun, llama_cpp_run  # noqa: E402
from gguf_agreement import TEXT  # noqa: E402
from report.headlines import Headline, write_headlines  # noqa: E402
from report.machine import commit  # noqa: E402
from rich.console import Console  # noqa: E402

from coordinator.errors import ApiError  # noqa: E402
from devtools.demo.gguf import GEMMA, packaged_gguf, stored_bytes  # noqa: E402
from devtools.demo.procs import demo_processes, free_port  # noqa: E402
from devtools.demo.steps import Api, pair_automatically  # noqa: E402
from partitioner.models.gguf.builder import GgufSource  # noqa: E402
from partitioner.models.gguf.units import unit_table  # noqa: E402
from protocols.gguf_card import WeightsMode  # noqa: E402

MODELS = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", GEMMA)
RESULTS = HERE / "results" / "gguf_speed.md"
MB = 1e6
GIB = 1 << 30
SHARE = 0.6
"""Each agent's planning cap as a share of the stored weights, plus :data:`RESERVE`: two agents
split the model."""
RESERVE = 256 << 20
"""Room in each cap for the planned KV cache (4 sessions of 1,024 tokens) and the runtime."""


@dataclass(frozen=True)
class Served:
    """fedshard's numbers for one model at one precision."""

    weights: str
    prefill_tps: float
    decode_tps: float
    tokens: int
    bytes_per_token: int
    gbps: float
    stages: int

    @property
    def bound_tps(self) -> float:
        """Decode tokens/s if every step only streamed its bytes at the agents' GB/s."""
        return self.gbps * 1e9 / self.bytes_per_token


def prompt_ids(gguf: Path, count: int) -> list[int]:
    """The first ``count`` ids of the agreement bench's text under the file's own tokenizer
    (the one the coordinator writes), repeated as needed."""
    from tokenizers import Tokenizer

    from coordinator.deploy.gguf_tokenizer import write_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        write_tokenizer(gguf, path)
        ids = Tokenizer.from_file(str(path)).encode(TEXT, add_special_tokens=False).ids
    while len(ids) < count:
        ids = ids + ids
    return ids[:count]


def decode_bytes(gguf: Path, weights: WeightsMode, context: int) -> int:
    """Bytes one decode step reads at ``context`` cached tokens (the unit table's roofline:
    weights as stored, the KV cache, the embedding's one row)."""
    table = unit_table(GgufSource(gguf).model, weights=weights, context=context)
    return sum(u.decode.bytes_read for u in table)


def serve(
    console: Console,
    gguf: Path,
    name: str,
    weights: WeightsMode,
    ids: list[int],
    args: argparse.Namespace,
) -> tuple[Served, LlamaRun | str]:
    """Start a coordinator and the agents, deploy ``gguf`` at ``weights``; then llama.cpp on
    the same file and fedshard back to back (the agents idle while llama.cpp runs), so both
    meet the same load."""
    stored = stored_bytes(gguf, weights)
    with tempfile.TemporaryDirectory(prefix="fedshard-speed-") as tmp:
        work = Path(tmp)
        with demo_processes(work / "logs") as procs:
            coordinator = procs.start_coordinator(work / "coordinator", free_port())
            suffix = secrets.token_hex(2)
            names = [f"speed{i}-{suffix}" for i in range(args.agents)]
            first, dirs = None, {}
            memory = f"{max(2, -(-int(stored * 1.5) // GIB))}GiB"
            for agent in names:
                child = procs.start_agent(
                    agent, memory, work / agent, profile_from=first, threads=args.threads
                )
                first = first or child.state_dir / "profile.json"
                dirs[agent] = child.state_dir
            assert first is not None
            gbps = float(json.loads(first.read_text())["memory_gbps"])
            api = Api(coordinator.url, coordinator.token)
            pair_automatically(console, api, dirs, procs.check_alive)
            caps = dict.fromkeys(names, int(SHARE * stored) + RESERVE) if args.agents > 1 else {}
            body = {
                "model_path": str(gguf.resolve()),
                "model_id": name,
                "memory_caps": caps,
                "weights": weights,
            }
            client = api.client(timeout=1800)
            started = time.monotonic()
            with console.status(f"deploying {name} ({weights})..."):
                version = client.expect("POST", "/v1/deployments", body)
            console.print(
                f"deployed {name} ({weights}) in {time.monotonic() - started:.0f} s on "
                f"{len(version['segments'])} agents"
            )
            client.set_speculative(name, "off")
            warm = {"model": name, "prompt": ids[:8], "max_tokens": 2, "temperature": 0}
            client.expect("POST", "/v1/completions", warm)
            with console.status(f"llama.cpp on {gguf.name}..."):
                llama = llama_cpp_run(gguf, ids, args.tokens, args.threads)
            console.print(f"llama.cpp {name}: {llama}")
            prefill = []
            for _ in range(2):
                one = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0}
                t0 = time.perf_counter()
                client.expect("POST", "/v1/completions", one)
                prefill.append(time.perf_counter() - t0)
            ask = {
                "model": name,
                "prompt": ids,
                "max_tokens": args.tokens,
                "temperature": 0,
                "stream_options": {"include_usage": True},
            }
            first_at = last_at = 0.0
            count = 0
            for chunk in client.stream("/v1/completions", ask):
                if chunk.usage:
                    count = int(chunk.usage["completion_tokens"])
                if chunk.choices:
                    first_at = first_at or time.perf_counter()
                    last_at = time.perf_counter()
            decode = (count - 1) / (last_at - first_at) if count > 1 and last_at > first_at else 0
    served = Served(
        weights=weights,
        prefill_tps=len(ids) / min(prefill),
        decode_tps=decode,
        tokens=count,
        bytes_per_token=decode_bytes(gguf, weights, len(ids) + args.tokens // 2),
        gbps=gbps,
        stages=len(version["segments"]),
    )
    return served, llama


def main() -> None:
    """Both engines per model and precision, side by side; write the table and headlines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--weights", default="keep,int4")
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (prefill)")
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "fedshard")
    args = parser.parse_args()
    console = Console()
    modes: list[WeightsMode] = [w for w in ("keep", "int4", "int8") if w in args.weights.split(",")]
    rows: list[tuple[str, Path, LlamaRun | str, Served]] = []
    for name in args.models.split(","):
        gguf = packaged_gguf(name, args.cache_dir)
        ids = prompt_ids(gguf, args.prompt)
        for weights in modes:
            try:
                served, llama = serve(console, gguf, name, weights, ids, args)
            except ApiError as exc:
                console.print(f"[red]{name} {weights}: {exc}[/]")
                continue
            console.print(f"fedshard {name} {weights}: {served}")
            rows.append((name, gguf, llama, served))
    write(args, rows)


def write(args: argparse.Namespace, rows: list[tuple[str, Path, LlamaRun | str, Served]]) -> None:
    """``bench/results/gguf_speed.md`` and its headlines."""
    lines = [
        "# GGUF one-stream decode and prefill: fedshard against llama.cpp and the memory bound",
        "",
        f"Measured {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC at commit {commit(REPO)}: "
        f"`.venv/bin/python bench/gguf_speed.py --agents {args.agents} --threads {args.threads} "
        f"--prompt {args.prompt} --tokens {args.tokens}`. fedshard: {args.agents} agents on "
        f"127.0.0.1, {args.threads} ONNX Runtime thread(s) each, the .gguf deployed under caps "
        f"of {SHARE:.0%} of its stored weights + {RESERVE >> 20} MiB per agent; llama.cpp: "
        f"node-llama-cpp's prebuilt CPU binary, one process, {args.threads} thread(s), the same "
        "file and prompt ids, run right before each fedshard measurement. "
        "Prefill: a "
        f"{args.prompt}-token prompt to its first token; decode: {args.tokens} greedy tokens "
        "after it. Bound: bytes read per decode step (weights as stored, KV cache, one "
        "embedding row) / the agents' measured streaming-read GB/s. This machine's two cores "
        "are shared with other work: the ratios, from the same run, are what counts.",
        "",
        "| model | weights | stages | fedshard prefill tok/s | llama.cpp prefill tok/s | "
        "prefill ratio | fedshard decode tok/s | llama.cpp decode tok/s | decode ratio | "
        "MB read / token | agents' GB/s | bound tok/s | decode / bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    headlines = []
    for name, gguf, llama, s in rows:
        if isinstance(llama, str):
            lp = ld = "-"
            pr = dr = float("nan")
        else:
            lp_v = len(prompt_ids(gguf, args.prompt)) / llama.ttft_s
            lp, ld = f"{lp_v:.1f}", f"{llama.decode_tps:.2f}"
            pr, dr = s.prefill_tps / lp_v, s.decode_tps / llama.decode_tps
        bound = s.decode_tps / s.bound_tps
        lines.append(
            f"| {name} | {s.weights} | {s.stages} | {s.prefill_tps:.1f} | {lp} | {pr:.2f} | "
            f"{s.decode_tps:.2f} | {ld} | {dr:.2f} | {s.bytes_per_token / MB:,.0f} | "
            f"{s.gbps:.1f} | {s.bound_tps:.1f} | {bound:.2f} |"
        )
        headlines += [
            Headline(f"{name} {s.weights}: decode fedshard / llama.cpp", dr, "x", ">= 0.9"),
            Headline(f"{name} {s.weights}: prefill fedshard / llama.cpp", pr, "x", ">= 0.7"),
            Headline(f"{name} {s.weights}: decode / memory-bandwidth bound", bound, "x", ">= 0.7"),
        ]
    for name, _, llama, _ in rows:
        if isinstance(llama, str):
            lines.append(f"\nllama.cpp did not run for {name}: {llama}")
    text = "\n".join(lines) + "\n"
    Console().print(text, highlight=False)
    RESULTS.write_text(text)
    write_headlines(RESULTS.stem, headlines, RESULTS.parent)


if __name__ == "__main__":
    main()
