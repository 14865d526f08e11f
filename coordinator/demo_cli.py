"""``fedshard demo``: a newcomer's first run, everything on 127.0.0.1.

It starts a coordinator and three agents as separate processes, pairs the agents through the API
(demo mode only), exports all-MiniLM-L6-v2 and deploys it under planning caps that force three
segments, prints the plan next to what the agents measured and a sentence-similarity matrix from
``/v1/embeddings``, does the same for Gemma 3 270M with a ``/v1/chat/completions`` answer, and
(unless ``--skip-training``) prints the summary of a two-round federated fine-tuning run with its
epsilon, which the coordinator ran in the background meanwhile. Then it prints the console
address and serves until Ctrl-C, which stops every process it started. Exports are kept in the
cache dir, so a second run starts faster.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from coordinator.demo_procs import DemoProcesses
    from coordinator.demo_steps import Api

DEFAULT_PORT = 8470
ROLES = ("nas", "laptop", "sbc")
GEMMA = "gemma3-270m"
QUESTION = "What does a router do in a home network?"
STOP = ("\nQuestion:",)
"""The packaged Gemma is the pretrained base model: it answers a question/answer prompt, then
would go on to ask itself the next question."""
CACHE_ENV = "FEDSHARD_CACHE"
TRAINING_ROUNDS = 2
PROFILE_FILE = "demo-profile.json"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand."""
    parser = subparsers.add_parser(
        "demo",
        help="run a coordinator and three agents on this machine and show them working",
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
        help="skip Gemma 3 270M (the text-generation part; its first export takes minutes)",
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
    console = Console()
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
    from coordinator.demo_procs import DemoProcessError, demo_processes, free_port, port_is_free
    from coordinator.demo_steps import DemoStepError

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
                _steps(console, args, root, port, procs, started)
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
) -> None:
    from coordinator.demo_steps import (
        AGENT_MEMORY,
        CAPS_MB,
        Api,
        budgets_table,
        deploy_minilm,
        export_model,
        pair_automatically,
        plan_table,
        similarity_table,
        start_training,
        training_summary,
    )

    state_dir = root / "coordinator"
    with console.status(f"starting the coordinator on 127.0.0.1:{port}..."):
        coordinator = procs.start_coordinator(state_dir, port, args.cache_dir / "segments")
    console.print(f"coordinator up at {coordinator.url} (state in {state_dir})")
    api = Api(coordinator.url, coordinator.token)
    suffix = _suffix(root)
    names = {role: f"{role}-{suffix}" for role in ROLES}
    console.print(budgets_table(names))
    kept = args.cache_dir / PROFILE_FILE
    profile = kept if kept.is_file() else None
    with console.status("starting three agents (the first run measures this machine)...") as st:
        for name in names.values():
            st.update(f"starting agent {name}...")
            agent = procs.start_agent(name, AGENT_MEMORY, root / "agents" / name, profile)
            profile = agent.state_dir / "profile.json"
            console.print(f"  agent {name} up (control port {agent.control_port})")
    _keep_profile(profile, kept)
    run_id = None
    if args.skip_training:
        console.print("federated fine-tuning skipped (--skip-training)")
    else:
        run_id = start_training(api, TRAINING_ROUNDS)
        console.print(
            f"federated fine-tuning started: {TRAINING_ROUNDS} rounds of the digits CNN on 3 "
            "local clients (Flower, SecAgg+, differential privacy), in the coordinator's "
            "background while the agents pair and the models deploy"
        )
    agent_dirs = {name: root / "agents" / name for name in names.values()}
    pair_automatically(console, api, agent_dirs, procs.check_alive)
    model = export_model(console, args.cache_dir / "exports" / "all-minilm-l6-v2")
    caps = {name: CAPS_MB[role] * 1000**2 for role, name in names.items()}
    deploy_minilm(console, api, model, caps)
    console.print(plan_table(api, state_dir))
    console.print(similarity_table(console, api))
    if args.skip_gemma:
        console.print("Gemma 3 270M skipped (--skip-gemma)")
    else:
        _gemma(console, api, state_dir, args.cache_dir, list(names.values()))
    if run_id is not None:
        training_summary(console, api, run_id, TRAINING_ROUNDS)
    procs.check_alive()
    console.print(f"ready in {time.monotonic() - started:.0f} s")
    console.print(f"console: {coordinator.console_url}", soft_wrap=True, highlight=False)
    if args.exit:
        return
    console.print("serving; press Ctrl-C to stop every process the demo started")
    while True:
        time.sleep(1.0)
        procs.check_alive()


def _gemma(console: Console, api: Api, state_dir: Path, cache_dir: Path, names: list[str]) -> None:
    """Export (cached), deploy across the three agents, print the plan and a chat answer."""
    from coordinator.demo_decoder import chat, deploy_decoder, export_decoder, three_way_caps
    from coordinator.demo_steps import plan_table

    export = export_decoder(console, GEMMA, cache_dir / "exports" / GEMMA, cache_dir)
    deploy_decoder(console, api, export, GEMMA, three_way_caps(export, names))
    console.print(plan_table(api, state_dir, GEMMA))
    with console.status(f"asking {GEMMA} through the three agents (/v1/chat/completions)..."):
        started = time.monotonic()
        reply = chat(api, GEMMA, QUESTION, stop=STOP)
    usage = reply["usage"]
    console.print(f"[bold]you:[/] {QUESTION}")
    console.print(f"[bold]{GEMMA}:[/] {reply['choices'][0]['message']['content'].strip()}")
    console.print(
        f"({usage['completion_tokens']} tokens in {time.monotonic() - started:.1f} s; each "
        "stage kept its own layers' KV cache, only hidden states crossed between agents)"
    )


def _keep_profile(measured: Path | None, kept: Path) -> None:
    """Keep this machine's measured profile for later runs: their agents plan with the same
    GFLOP/s, so a later run cuts the models the same way and reuses the cached segments."""
    if measured is None or kept.is_file() or not measured.is_file():
        return
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_suffix(".partial")
    shutil.copyfile(measured, partial)
    partial.replace(kept)


def _suffix(root: Path) -> str:
    """A short tag for device names: stable for a kept state dir (a second run reuses its agents'
    keys and pairings) and distinct from other runs on this host (mDNS on 127.0.0.1 is shared)."""
    return hashlib.sha256(str(root).encode()).hexdigest()[:6]
