"""``fedshard demo``: a newcomer's first run, everything on 127.0.0.1.

It starts a coordinator and four agents as separate processes, pairs the agents through the API
(demo mode only), exports all-MiniLM-L6-v2 and deploys it under planning caps that no single
agent can hold it under (while any three of the four still can), prints the plan next to what
the agents measured and a sentence-similarity matrix from ``/v1/embeddings``, does the same for
the decoder (Qwen2.5-Coder-1.5B-Instruct by default, which no agent can hold) with a
``/v1/chat/completions`` answer. A decoder whose GGUF file comes with a package (Qwen, Gemma) is
served from that file itself (:mod:`devtools.demo.gguf`: planned from its header, each stage's
segment built from its own tensors in the file's own quantization, nothing converted to float32;
the coordinator's peak memory is printed next to the file's size), unless the demo fine-tunes it:
federated LoRA still needs the torch export (``fedshard export``), whose answer is checked
against the whole model in one ONNX Runtime session. Then
(unless ``--skip-training``) fine-tunes a served chat model with federated LoRA on three local
devices' WordNet text (SecAgg+, record-level DP): the decoder itself where the demo has measured
its training (Gemma 3 270M, tiny-llama), else Gemma 3 270M, which it then serves as well. The
demo is ready (it prints the console address) once every model serves and that run has
started; the run goes on while they serve, rolls the merged version out live and the demo
prints the held-out loss before and after, the epsilon per device, the upload, and one held-out
question answered before and after (:mod:`devtools.demo.training`). Then it serves until
Ctrl-C, which stops every process it started. While serving, an agent that exits is reported
with what failover did about it and restarted a few seconds later, so the models expand back
onto it. ``--chaos`` shows exactly that under the demo's own load: an agent killed mid-stream,
no request lost. Exports are kept in the cache dir, so a second run starts faster.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from coordinator.commands import wide_when_piped
from devtools.demo import training
from devtools.demo.procs import (
    DemoProcessError,
    DemoProcesses,
    demo_processes,
    free_port,
    port_is_free,
)
from devtools.demo.steps import (
    AGENT_MEMORY,
    MODEL_ID,
    Api,
    DemoStepError,
    after_a_loss,
    budgets_table,
    deploy_calibrated,
    deploy_minilm,
    export_model,
    minilm_caps,
    pair_automatically,
    plan_table,
    planning_limits,
    similarity_table,
)
from devtools.demo.supervise import AgentSupervisor
from devtools.demo.training import RUNS, write_target
from devtools.reference import greedy_chat_reference
from protocols.sizes import parse_size

DEFAULT_PORT = 8470
ROLES = ("nas", "laptop", "sbc", "desktop")
GEMMA = "gemma3-270m"
QWEN = "qwen2.5-coder-1.5b"
DECODERS = (QWEN, GEMMA, "tiny-llama")
"""Decoders the demo can serve: Qwen and Gemma from their packaged GGUF files (weights ``keep``),
or from their torch export in its default precision (Gemma int8) where the demo fine-tunes them;
``tiny-llama`` is a small random model (always exported): fast, for scripts."""
TRAINED_INSTEAD = GEMMA
"""The chat model the demo fine-tunes when it has not measured training for the served
decoder (Qwen 1.5B: its rounds are too slow on 2 cores); it is deployed as well."""
QUESTION = "What does a router do in a home network?"
STOP = ("\nQuestion:",)
"""The packaged Gemma is the pretrained base model: it answers a question/answer prompt, then
would go on to ask itself the next question."""
CACHE_ENV = "FEDSHARD_CACHE"
TRAINING_TIMEOUT_S = 3600.0
PROFILE_FILE = "demo-profile.json"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand."""
    parser = subparsers.add_parser(
        "demo",
        help="run a coordinator and four agents on this machine and show them working",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"coordinator API and console port (default {DEFAULT_PORT}; "
        "a free port is used instead if it is taken)",
    )
    parser.add_argument(
        "--skip-training", action="store_true", help="skip the federated fine-tuning part"
    )
    parser.add_argument(
        "--skip-gemma",
        action="store_true",
        help="skip the text-generation part (the decoders' first exports take minutes)",
    )
    parser.add_argument(
        "--decoder",
        choices=DECODERS,
        default=QWEN,
        help=f"the text-generation model (default {QWEN})",
    )
    parser.add_argument(
        "--chaos",
        action="store_true",
        help="once ready, run a bounded load, kill one agent mid-stream, restart it, and print "
        "what was lost (nothing, is the target) and how long noticing, re-planning and expanding "
        "back took; the exit code is 1 when a request was lost",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"converted checkpoints and exports kept between runs (${CACHE_ENV}, else "
        "~/.cache/fedshard)",
    )
    parser.add_argument(
        "--exit", action="store_true", help="exit after printing instead of serving until Ctrl-C"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="keep the coordinator's and agents' state, the exported model and logs here "
        "(default: a temporary directory, removed at exit); a second run reuses it",
    )
    parser.add_argument(
        "--pid-file",
        type=Path,
        help="append 'PID NAME' of every process the demo starts to this file (for scripts)",
    )
    parser.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code."""
    console = wide_when_piped(Console())
    console.rule("[bold]fedshard demo")
    if args.cache_dir is None:
        args.cache_dir = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fedshard")
    started = time.monotonic()
    if args.state_dir is not None:
        root = args.state_dir.expanduser().resolve()
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        return _run(console, args, root, started)
    with tempfile.TemporaryDirectory(prefix="fedshard-demo-") as tmp:
        return _run(console, args, Path(tmp), started)


def _run(console: Console, args: argparse.Namespace, root: Path, started: float) -> int:
    port = args.port
    if port == 0 or not port_is_free(port):
        chosen = free_port()
        if port:
            console.print(f"[yellow]port {port} is taken; using {chosen} instead[/]")
        port = chosen
    console.print(f"working directory: {root}")
    code = 0
    try:
        with demo_processes(root / "logs", args.pid_file) as procs:
            try:
                code = _steps(console, args, root, port, procs, started)
            finally:
                with console.status("stopping every process the demo started..."):
                    stopped = procs.stop_all()
                if stopped:
                    console.print(f"stopped {', '.join(stopped)}")
    except KeyboardInterrupt:
        console.print("interrupted; every process the demo started is stopped")
    except (DemoProcessError, DemoStepError, OSError) as exc:
        console.print(f"[red]demo failed:[/] {exc}")
        if args.state_dir is not None:
            console.print(f"logs: {root / 'logs'}")
        code = 1
    return code


def _steps(
    console: Console,
    args: argparse.Namespace,
    root: Path,
    port: int,
    procs: DemoProcesses,
    started: float,
) -> int:
    """Every step of the demo; the exit code (1 when ``--chaos`` lost a request)."""
    state_dir = root / "coordinator"
    target, data_dirs = _training_target(console, args, state_dir)
    with console.status(f"starting the coordinator on 127.0.0.1:{port}..."):
        coordinator = procs.start_coordinator(state_dir, port, args.cache_dir / "segments", target)
    console.print(f"coordinator up at {coordinator.url} (state in {state_dir})")
    api = Api(coordinator.url, coordinator.token)
    suffix = _suffix(root)
    names = [f"{role}-{suffix}" for role in ROLES]
    kept = args.cache_dir / PROFILE_FILE
    profile = kept if kept.is_file() else None
    with console.status(
        f"starting {len(names)} agents (the first run measures this machine)..."
    ) as st:
        for name in names:
            st.update(f"starting agent {name}...")
            agent = procs.start_agent(name, AGENT_MEMORY, root / "agents" / name, profile)
            profile = agent.state_dir / "profile.json"
            console.print(f"  agent {name} up (control port {agent.control_port})")
    _keep_profile(profile, kept)
    agent_dirs = {name: root / "agents" / name for name in names}
    pair_automatically(console, api, agent_dirs, procs.check_alive)
    model = export_model(console, args.cache_dir / "exports" / "all-minilm-l6-v2")
    caps = minilm_caps(model, names)
    console.print(budgets_table("all-MiniLM-L6-v2", model, caps))
    deploy_calibrated(console, api, MODEL_ID, lambda: deploy_minilm(console, api, model, caps))
    console.print(plan_table(api, state_dir))
    console.print(after_a_loss(api, MODEL_ID, caps))
    console.print(similarity_table(console, api))
    decoder = None
    trained = _trained_decoder(args) if data_dirs else None
    if args.skip_gemma:
        console.print("text generation skipped (--skip-gemma)")
    else:
        decoder = _decoder(
            console, api, state_dir, args.decoder, args.cache_dir, names,
            from_gguf=args.decoder != trained,
        )  # fmt: skip
    fine_tuning = None
    if data_dirs and trained is not None:
        if trained != args.decoder:
            console.print(
                f"federated fine-tuning of {args.decoder} is not measured on this machine; "
                f"the demo serves and fine-tunes {trained} as well"
            )
            _decoder(console, api, state_dir, trained, args.cache_dir, names, check=False)
        console.print(
            f"{trained} is served from its torch export (`fedshard export`, float32 once) "
            "because the demo fine-tunes it: federated LoRA does not work yet on a version "
            "built from a GGUF file",
            soft_wrap=True,
        )
        fine_tuning = _start_fine_tuning(console, api, trained, data_dirs)
    procs.check_alive()
    console.print(f"ready in {time.monotonic() - started:.0f} s")
    console.print(f"console: {coordinator.console_url}", soft_wrap=True, highlight=False)
    if fine_tuning is not None:
        console.print("(its Training page follows the fine-tuning run live)")
        _finish_fine_tuning(console, api, fine_tuning)
        console.print(f"fine-tuned and rolled out in {time.monotonic() - started:.0f} s")
    return _serve(console, args, api, procs, model, decoder)


def _serve(
    console: Console,
    args: argparse.Namespace,
    api: Api,
    procs: DemoProcesses,
    encoder: Path,
    decoder: Path | None,
) -> int:
    """The chaos run if asked for; then serve until Ctrl-C unless ``--exit``."""
    # heavy: httpx (coordinator extra), absent on an agent-only install whose parser imports us
    from devtools.demo.chaos import ChaosTarget, run_chaos

    supervisor = AgentSupervisor(console, api, procs)
    code = 0
    if args.chaos:
        target = ChaosTarget(encoder, None if args.skip_gemma else args.decoder, decoder)
        outcome = run_chaos(console, api, supervisor, target)
        code = 0 if outcome.ok else 1
    if args.exit:
        return code
    console.print(
        "serving; press Ctrl-C to stop every process the demo started (an agent that exits is "
        "restarted, and the models expand back onto it)"
    )
    supervisor.skip_history()
    while True:
        time.sleep(1.0)
        supervisor.poll()


def _decoder(
    console: Console,
    api: Api,
    state_dir: Path,
    name: str,
    cache_dir: Path,
    names: list[str],
    *,
    check: bool = True,
    from_gguf: bool = False,
) -> Path | None:
    """Deploy across the agents, print the plan and a chat answer; the export, or None when
    the model was served from its packaged GGUF file (``from_gguf``, where it has one).

    From an export (cached; ``check``: the answer next to the whole model's in one ONNX
    Runtime session), or from the GGUF file, each stage built from its own tensors."""
    # heavy: devtools.demo.gguf brings onnx (the GGUF builder)
    from devtools.demo import gguf

    # heavy: devtools.demo.decoder brings onnx (the partitioner's decoders)
    from devtools.demo.decoder import chat

    if from_gguf and name in gguf.PACKAGED:
        export, caps = None, _deploy_gguf(console, api, name, cache_dir, names)
    else:
        export, caps = _deploy_export(console, api, name, cache_dir, names)
    console.print(plan_table(api, state_dir, name))
    try:
        console.print(after_a_loss(api, name, planning_limits(caps, names)))
    except DemoStepError as exc:
        if export is not None:
            raise
        # the coordinator's what-if plans ONNX files only so far (it reads a GGUF as ONNX)
        console.print(f"[yellow]{name}: what losing an agent leaves is not shown:[/] {exc}")
    with console.status(f"asking {name} through the agents (/v1/chat/completions)..."):
        started = time.monotonic()
        reply = chat(api, name, QUESTION, stop=STOP)
    usage = reply["usage"]
    answer = str(reply["choices"][0]["message"]["content"])
    console.print(f"[bold]you:[/] {QUESTION}")
    console.print(f"[bold]{name}:[/] {answer.strip()}")
    console.print(
        f"({usage['completion_tokens']} tokens in {time.monotonic() - started:.1f} s; each "
        "stage kept its own layers' KV cache, only hidden states crossed between agents)"
    )
    if export is None:
        console.print(
            "(served from the GGUF file: no whole-model ONNX file exists to compare with; "
            "bench/gguf_agreement.py compares the served segments with llama.cpp on the file)"
        )
    elif check:
        _compare_with_one_session(console, export, answer)
    return export


def _deploy_export(
    console: Console, api: Api, name: str, cache_dir: Path, names: list[str]
) -> tuple[Path, dict[str, int]]:
    """Export ``name`` with torch (cached) and deploy that export; the export and the caps."""
    # heavy: devtools.demo.decoder brings onnx (the partitioner's decoders)
    from devtools.demo.decoder import decoder_caps, deploy_decoder, export_decoder
    from partitioner.models.decoders.precision import default_weights

    weights = default_weights(name)
    out = cache_dir / "exports" / f"{name}-{weights}"
    export = export_decoder(console, name, out, cache_dir, weights)
    caps = decoder_caps(export, names, parse_size(AGENT_MEMORY))
    console.print(budgets_table(f"{name} ({weights})", export / "model.onnx", caps, names))
    deploy_calibrated(console, api, name, lambda: deploy_decoder(console, api, export, name, caps))
    return export, caps


def _deploy_gguf(
    console: Console, api: Api, name: str, cache_dir: Path, names: list[str]
) -> dict[str, int]:
    """Deploy ``name``'s packaged GGUF file itself (nothing converted to float32); the caps."""
    # heavy: devtools.demo.gguf brings onnx (the GGUF builder's unit table)
    from devtools.demo import gguf

    with console.status(f"joining {name}'s GGUF file from its package (once; cached)..."):
        path = gguf.packaged_gguf(name, cache_dir)
    stored = gguf.stored_bytes(path)
    caps = gguf.gguf_caps(path, names, parse_size(AGENT_MEMORY))
    console.print(
        f"{name}: serving {path.name} ({path.stat().st_size / 1e6:.0f} MB) as it is, weights "
        f"{gguf.WEIGHTS} ({stored / 1e6:.0f} MB as the agents store them)",
        soft_wrap=True,
        highlight=False,
    )
    title = f"{name} ({gguf.WEIGHTS})"
    console.print(budgets_table(title, path, caps, names, weights=stored))
    # one deploy: a re-plan on the first stages' measurements can overflow the caps (measured
    # 61 MiB over on one device), and the first plan already holds under half on each agent
    gguf.deploy_gguf(console, api, path, name, caps)
    return caps


def _compare_with_one_session(console: Console, export: Path, answer: str) -> None:
    """Print whether the whole model in one local ONNX Runtime session answers the same."""
    # heavy: devtools.demo.decoder brings onnx (the partitioner's decoders)
    from devtools.demo.decoder import CHAT_TOKENS

    with console.status("the same question to the whole model in one ONNX Runtime session..."):
        started = time.monotonic()
        alone = greedy_chat_reference(export, QUESTION, CHAT_TOKENS, STOP)
    seconds = time.monotonic() - started
    if alone == answer:
        console.print(
            f"[green]the whole model in one ONNX Runtime session answers the same, token for "
            f"token[/] ({seconds:.0f} s here, in one process that holds all of it)"
        )
    else:
        console.print(
            f"[red]the whole model in one ONNX Runtime session answers otherwise:[/] {alone}"
        )


def _training_target(
    console: Console, args: argparse.Namespace, state_dir: Path
) -> tuple[Path | None, list[Path]]:
    """The LoRA training target of the chat model the demo fine-tunes and its devices' data
    dirs (none when training is skipped or no decoder is served)."""
    if args.skip_training:
        console.print("federated fine-tuning skipped (--skip-training)")
        return None, []
    if args.skip_gemma:
        console.print("federated fine-tuning skipped (no decoder is served)")
        return None, []
    os.environ[CACHE_ENV] = str(args.cache_dir)  # the coordinator maps the decoder from it
    with console.status("writing three devices' WordNet text (training target)..."):
        target, dirs = write_target(state_dir, _trained_decoder(args), args.cache_dir / "lora")
    return target, dirs


def _trained_decoder(args: argparse.Namespace) -> str:
    """The chat model the demo fine-tunes: the served decoder, if its training is measured."""
    return str(args.decoder) if args.decoder in RUNS else TRAINED_INSTEAD


@dataclass(frozen=True)
class FineTuning:
    """A started fine-tuning run of the demo and its held-out question, asked before it."""

    model_id: str
    run_id: str
    question: str
    reference: str
    before: str


def _start_fine_tuning(
    console: Console, api: Api, model_id: str, data_dirs: list[Path]
) -> FineTuning:
    """Ask one held-out question, then start federated LoRA of the served decoder."""
    question, reference = training.held_out_question(data_dirs)
    before = training.ask(api, model_id, question, STOP)
    run = training.RUNS[model_id]
    run_id = training.start(api, model_id)
    console.print(
        f"federated fine-tuning started: LoRA (rank {run.rank}, layers {run.first_layer} to "
        f"the last) of "
        f"the served {model_id}, {run.rounds} round(s) on 3 local devices with "
        f"{run.per_device} WordNet records each (Flower, SecAgg+, Opacus DP-SGD); every model "
        "serves meanwhile"
    )
    return FineTuning(model_id, run_id, question, reference, before)


def _finish_fine_tuning(console: Console, api: Api, started: FineTuning) -> None:
    """Wait for the run and its live rollout; the held-out question answered again."""
    run = training.RUNS[started.model_id]
    status = training.wait(console, api, started.run_id, run.rounds, TRAINING_TIMEOUT_S)
    training.summary(console, started.model_id, status)
    after = training.ask(api, started.model_id, started.question, STOP)
    console.print(f"[bold]held-out question:[/] {started.question}")
    console.print(f"  WordNet: {started.reference}", soft_wrap=True)
    console.print(f"  before: {started.before}", soft_wrap=True)
    console.print(f"  after:  {after}", soft_wrap=True)


def _keep_profile(measured: Path | None, kept: Path) -> None:
    """Keep this machine's measured profile for later runs: their agents plan with the same
    GFLOP/s, so a later run cuts the models the same way and reuses the cached segments. A kept
    profile the agents measured again (one that lacks a newer roof) is replaced."""
    if measured is None or not measured.is_file():
        return
    if kept.is_file() and kept.read_bytes() == measured.read_bytes():
        return
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_suffix(".partial")
    shutil.copyfile(measured, partial)
    partial.replace(kept)


def _suffix(root: Path) -> str:
    """A short tag for device names: stable for a kept state dir (a second run reuses its agents'
    keys and pairings) and distinct from other runs on this host (mDNS on 127.0.0.1 is shared)."""
    return hashlib.sha256(str(root).encode()).hexdigest()[:6]
