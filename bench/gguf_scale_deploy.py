"""Scale (issue 40 item 8), part B: a Llama-3-8B-shaped GGUF served across agents on 127.0.0.1.

Writes (or takes, ``--gguf``) a GGUF with Llama-3-8B's shapes, llama.cpp's Q4_K_M type mix and
random weights, written one tensor at a time (:mod:`_gguf_llama3`). First says, from the unit
table alone, whether the file fits ``--agents`` agents of ``--memory`` with ``--weights keep``
or ``int4`` (the planner's own problem: weights as ONNX Runtime holds them, the default
sessions' KV cache, the runtime's overhead) and the least memory per agent that fits each.
Then starts a coordinator and the agents (one ONNX Runtime thread each), deploys the file with
``fedshard deploy FILE.gguf``, and prints side by side:

- the deploy's peak resident memory (the coordinator's build) against the largest segment +
  300 MB (issue 40 item 3's bound);
- each agent's resident memory (``VmRSS``) next to the GGUF bytes of the layers it holds;
- decode tokens/s of a streamed greedy chat completion, next to llama.cpp in one process on the
  same file with the same threads (node-llama-cpp, ``make bench-setup``; skipped with
  ``--no-llama-cpp``)::

    python bench/gguf_scale_deploy.py --agents 8 --memory 768MiB --weights auto --tokens 16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _gguf_llama3 import LLAMA3_8B, write_random
from _llama_cpp import llama_cpp_run

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests")]

from agent_helpers import AgentProc  # noqa: E402
from coordinator_helpers import (  # noqa: E402
    CoordinatorProc,
    pairing_code,
    start_coordinator,
    stop_process,
    unpaired_agents,
    wait_for,
)

from coordinator.deploy.gguf_plan import planning_problem, unit_table  # noqa: E402
from coordinator.deploy.store import segment_dir  # noqa: E402
from partitioner.errors import InfeasiblePlanError  # noqa: E402
from partitioner.models.gguf.header import GgufModel, read_header  # noqa: E402
from partitioner.models.gguf.kernels import WeightsMode  # noqa: E402
from partitioner.models.gguf.units import unit_table as raw_units  # noqa: E402
from partitioner.planning.planner import plan  # noqa: E402
from protocols.devices import DeviceList  # noqa: E402
from protocols.manifest import DEFAULT_SESSIONS, MANIFEST_FILE, Manifest  # noqa: E402
from protocols.sizes import parse_size  # noqa: E402

MB = 1e6
MIB = 1 << 20
BOUND_MARGIN = 300 * MB
MODEL_ID = "llama3-8b-shaped"
MODES: tuple[WeightsMode, ...] = ("keep", "int4")


def fits(model: GgufModel, mode: WeightsMode, agents: int, memory: int) -> int:
    """0 when ``agents`` devices of ``memory`` bytes hold ``model`` at ``mode``, else the
    planner's shortfall in bytes."""
    table = unit_table(model, DEFAULT_SESSIONS, mode)
    devices = DeviceList.model_validate(
        {
            "devices": [
                {"name": f"a{i}", "memory_bytes": memory, "gflops": 10, "bandwidth_mbps": 1000}
                for i in range(agents)
            ]
        }
    )
    try:
        plan(planning_problem(table, devices, MODEL_ID))
    except InfeasiblePlanError as exc:
        return max(exc.shortfall_bytes, 1)
    return 0


def least_memory(model: GgufModel, mode: WeightsMode, agents: int) -> int:
    """The least memory per agent (a multiple of 64 MiB) at which ``agents`` agents fit."""
    memory = 256 * MIB
    while fits(model, mode, agents, memory):
        memory += 64 * MIB
    return memory


def fit_report(model: GgufModel, agents: int, memory: int) -> dict[WeightsMode, bool]:
    """Print, per weights mode, the weights, KV and whether ``agents`` x ``memory`` holds them."""
    answer: dict[WeightsMode, bool] = {}
    for mode in MODES:
        table = unit_table(model, DEFAULT_SESSIONS, mode)
        weights = sum(u.weight_bytes for u in table.units.units)
        largest = max(u.weight_bytes for u in table.units.units)
        short = fits(model, mode, agents, memory)
        answer[mode] = short == 0
        verdict = "fits" if short == 0 else f"does not fit (short by {short / MIB:.0f} MiB)"
        print(
            f"--weights {mode}: weights {weights / MIB:.0f} MiB (largest unit {largest / MIB:.0f} "
            f"MiB) + KV {sum(table.state_bytes) / MIB:.0f} MiB ({DEFAULT_SESSIONS.max_sessions} "
            f"sessions x {DEFAULT_SESSIONS.max_context} tokens) on {agents} x "
            f"{memory / MIB:.0f} MiB: {verdict}; least per agent that fits: "
            f"{least_memory(model, mode, agents) / MIB:.0f} MiB"
        )
    return answer


@dataclass(frozen=True)
class Choice:
    """The weights mode and memory per agent the run uses."""

    mode: WeightsMode
    memory: int
    why: str


def choose(model: GgufModel, agents: int, memory: int, wanted: str) -> Choice:
    """``wanted`` (or, for ``auto``, ``keep`` where it fits, else ``int4``), at ``memory`` per
    agent where that fits, else at the least memory that does (stated)."""
    answer = fit_report(model, agents, memory)
    if wanted != "auto":
        mode: WeightsMode = "keep" if wanted == "keep" else "int4"
    else:
        mode = "keep" if answer["keep"] or not answer["int4"] else "int4"
    if answer[mode]:
        return Choice(mode, memory, f"{mode} fits {agents} x {memory / MIB:.0f} MiB")
    more = least_memory(model, mode, agents)
    why = f"{mode} needs {more / MIB:.0f} MiB per agent (asked {memory / MIB:.0f} MiB)"
    return Choice(mode, more, why)


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def stream_decode(coordinator: CoordinatorProc, tokens: int) -> tuple[float, float, int]:
    """One streamed greedy chat completion: (time to first token, decode tokens/s, tokens)."""
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "the devices of a local network"}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = 0.0
    count = 0
    for chunk in coordinator.api(timeout=1800).stream("/v1/chat/completions", body):
        if chunk.usage:
            count = int(chunk.usage["completion_tokens"])
        if chunk.choices and chunk.choices[0]["delta"].get("content") is not None:
            first = first or time.perf_counter()
    last = time.perf_counter()
    decode = (count - 1) / (last - first) if count > 1 and last > first else 0.0
    return first - start, decode, count


def stage_bytes(model: GgufModel, manifest: Manifest) -> dict[str, tuple[int, str]]:
    """Per device: the GGUF bytes of the units its segment holds, and their names."""
    table = raw_units(model)
    out: dict[str, tuple[int, str]] = {}
    for s in manifest.segments:
        start, end = s.units
        names = f"{table[start].name}..{table[end - 1].name}"
        out[s.device] = (sum(u.file_bytes for u in table[start:end]), names)
    return out


def deploy_and_measure(gguf: Path, work: Path, choice: Choice, agents: int, tokens: int) -> float:
    """Start the coordinator and agents, deploy, print the numbers; decode tokens/s."""
    model = read_header(gguf)
    coordinator = start_coordinator(work)
    try:
        names = [f"g{i}" for i in range(agents)]
        memory = f"{choice.memory // MIB}MiB"
        with unpaired_agents(work, names, memory) as procs:
            api = coordinator.api()
            assert wait_for(lambda: set(names) <= {d.name for d in api.devices()}, 30)
            for agent in procs:
                paired = coordinator.cli("pair", agent.name, pairing_code(agent))
                assert paired.returncode == 0, paired.stdout + paired.stderr
            rss_idle = {a.name: rss_bytes(a.proc.pid) for a in procs}
            started = time.monotonic()
            args = ["deploy", str(gguf), "--name", MODEL_ID, "--weights", choice.mode]
            deployed = coordinator.cli(*args, "--speculative", "off", timeout=3600)
            seconds = time.monotonic() - started
            if deployed.returncode != 0:
                raise RuntimeError(deployed.stdout + deployed.stderr + coordinator.log()[-3000:])
            print(deployed.stdout.strip())
            print(f"fedshard deploy took {seconds:.0f} s")
            report_build(coordinator)
            report_agents(coordinator, model, procs, rss_idle)
            ttft, decode, count = stream_decode(coordinator, tokens)
            print(
                f"fedshard: {count} tokens, time to first token {ttft:.2f} s, decode "
                f"{decode:.2f} tokens/s ({agents} agents x 1 thread, one stream)"
            )
            after = {a.name: rss_bytes(a.proc.pid) for a in procs}
            print(
                "resident after decoding: "
                + ", ".join(f"{n} {b / MB:.0f} MB" for n, b in after.items())
            )
            return decode
    finally:
        stop_process(coordinator.proc)


def report_build(coordinator: CoordinatorProc) -> None:
    """The deploy's peak resident memory against the largest segment + 300 MB."""
    [entry] = [m for m in coordinator.api().console_models() if m.model_id == MODEL_ID]
    if entry.gguf is None or entry.gguf.build is None:
        raise RuntimeError(f"{MODEL_ID} has no GGUF build card")
    build = entry.gguf.build
    peak = build.deploy_peak_rss_bytes or build.peak_rss_bytes
    bound = build.largest_segment_bytes + BOUND_MARGIN
    print(
        f"deploy peak resident memory {peak / MB:.0f} MB (build alone "
        f"{build.peak_rss_bytes / MB:.0f} MB) | largest segment "
        f"{build.largest_segment_bytes / MB:.0f} MB + 300 MB = {bound / MB:.0f} MB | peak / bound "
        f"{peak / bound:.2f} ({'below' if peak < bound else 'ABOVE'} the bound); segments "
        f"{build.segment_bytes / MB:.0f} MB in all, build {build.seconds:.0f} s"
    )


def report_agents(
    coordinator: CoordinatorProc, model: GgufModel, procs: list[AgentProc], idle: dict[str, int]
) -> None:
    """Each agent's resident memory next to the GGUF bytes of its layers."""
    live = coordinator.api().active_version(MODEL_ID)
    vdir = segment_dir(coordinator.state_dir, MODEL_ID, live.plan_version)
    manifest = Manifest.model_validate_json((vdir / MANIFEST_FILE).read_text())
    held = stage_bytes(model, manifest)
    print(
        f"{'agent':6s} {'units':22s} {'GGUF bytes':>11s} {'resident':>9s} {'ratio':>6s} "
        f"{'idle':>7s}"
    )
    for agent in procs:
        rss = rss_bytes(agent.proc.pid)
        gguf, names = held.get(agent.name, (0, "-"))
        ratio = f"{rss / gguf:6.2f}" if gguf else "     -"
        print(
            f"{agent.name:6s} {names:22s} {gguf / MB:8.0f} MB {rss / MB:6.0f} MB {ratio} "
            f"{idle[agent.name] / MB:4.0f} MB"
        )


def main() -> None:
    """Parse arguments; fit, deploy, measure, compare."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="an existing Llama-3-8B-shaped file")
    parser.add_argument("--dir", type=Path, help="where to write the file and state")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--memory", default="768MiB")
    parser.add_argument("--weights", choices=("auto", "keep", "int4"), default="auto")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--keep-file", action="store_true", help="do not delete a written file")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="gguf-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    gguf = args.gguf
    if gguf is None:
        gguf = work / "llama3-8b-q4_k_m.gguf"
        started = time.monotonic()
        write_random(gguf, LLAMA3_8B)
        print(f"wrote {gguf.stat().st_size / MB:.0f} MB in {time.monotonic() - started:.0f} s")
    model = read_header(gguf)
    print(f"{gguf.name}: {gguf.stat().st_size / MB:.0f} MB, {model.layers} layers")
    choice = choose(model, args.agents, parse_size(args.memory), args.weights)
    print(
        f"running with --weights {choice.mode}, {choice.memory / MIB:.0f} MiB per agent: "
        f"{choice.why}"
    )
    try:
        decode = deploy_and_measure(gguf, work, choice, args.agents, args.tokens)
        if args.no_llama_cpp:
            print("llama.cpp: skipped (--no-llama-cpp)")
            return
        ids = list(range(300, 332))
        for threads in (1, 2):
            run = llama_cpp_run(gguf, ids, args.tokens, threads)
            if isinstance(run, str):
                print(f"llama.cpp ({threads} thread(s)): not run: {run}")
                continue
            print(
                f"llama.cpp, one process, {threads} thread(s): decode {run.decode_tps:.2f} "
                f"tokens/s, resident {run.resident_bytes / MB:.0f} MB | fedshard / llama.cpp "
                f"decode {decode / run.decode_tps:.2f}"
            )
    finally:
        if args.gguf is None and not args.keep_file:
            gguf.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
