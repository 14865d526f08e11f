"""``fedshard lab up|down|exec|status``: a LAN of N hosts on this machine (root needed).

``lab up`` stays in the foreground; Ctrl-C, SIGTERM, SIGHUP or any error removes every
namespace, veth, bridge and process it made. ``lab down`` does the same from another process.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.table import Table

from devtools.lab.errors import LabError, LabSpecError, LabUnavailableError
from devtools.lab.executor import lab_netns, require_tools, teardown
from devtools.lab.lab import Lab, down_from_state
from devtools.lab.procs import is_alive
from devtools.lab.spec import DEFAULT_MEMORY, DEFAULT_SUBNET, LabSpec
from devtools.lab.state import LATENCY_NOTE, LabState, load_state, remove_state

log = logging.getLogger(__name__)
DEFAULT_STATE_DIR = Path.home() / ".fedshard" / "lab"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """Raised in the main thread by SIGINT, SIGTERM or SIGHUP while ``lab up`` runs."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lab`` with its ``up``, ``down``, ``exec`` and ``status`` subcommands."""
    lab = subparsers.add_parser(
        "lab",
        help="a LAN of N hosts on this machine (network namespaces; root)",
        description="Hosts as network namespaces on one bridge, shaped with tbf, one agent each.",
    )
    sub = lab.add_subparsers(dest="lab_command", required=True, metavar="SUBCOMMAND")

    up = sub.add_parser("up", help="build the lab and keep it until Ctrl-C")
    up.add_argument("hosts", type=int, metavar="N", help="number of hosts")
    up.add_argument("--bandwidth-mbps", default="", help="Mbit/s per host, e.g. 100,50,20")
    up.add_argument(
        "--latency-ms", default="", help="one-way ms per host (recorded; no netem here)"
    )
    up.add_argument("--memory", default=DEFAULT_MEMORY, help="agent memory budget(s), e.g. 256MiB")
    up.add_argument("--names", default="", help="host names (default h0,h1,...)")
    up.add_argument("--subnet", default=DEFAULT_SUBNET, help="inside 10.77.0.0/16")
    up.add_argument("--no-agents", action="store_true", help="only the network")
    up.add_argument("--wait-s", type=float, default=120.0, help="wait for mDNS discovery (0: no)")
    up.add_argument("--lab-id", help="hex id used in namespace names (default: random)")
    _state_dir_arg(up)
    up.set_defaults(run=run_up)

    down = sub.add_parser("down", help="remove the lab (idempotent)")
    down.add_argument("--lab-id", help="remove lab ID by its namespace names, state file or not")
    _state_dir_arg(down)
    down.set_defaults(run=run_down)

    run = sub.add_parser("exec", help="run a command inside a lab host: lab exec HOST -- CMD")
    run.add_argument("host", help="host name, or ctl (the bridge's namespace, for a coordinator)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command after --")
    _state_dir_arg(run)
    run.set_defaults(run=run_exec)

    status = sub.add_parser("status", help="show the lab's hosts, addresses and agents")
    status.add_argument("--json", action="store_true", help="print the state file and liveness")
    _state_dir_arg(status)
    status.set_defaults(run=run_status)


def _state_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="where lab.json and logs live"
    )


def run_up(args: argparse.Namespace) -> int:
    """Handler of ``lab up``: build, show, serve until a signal, then remove everything."""
    _logging()
    console = Console()
    try:
        spec = LabSpec.build(
            args.hosts,
            bandwidth_mbps=args.bandwidth_mbps,
            latency_ms=args.latency_ms,
            memory=args.memory,
            names=args.names,
            subnet=args.subnet,
            agents=not args.no_agents,
        )
        lab = Lab(spec, args.state_dir, lab_id=args.lab_id)
    except LabSpecError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    try:
        require_tools()
    except LabUnavailableError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    code = 0
    with _stop_on_signals():
        try:
            with console.status(f"building lab {lab.plan.lab_id} ({args.hosts} hosts)"):
                lab.up()
            devices: list[dict[str, Any]] = []
            if spec.agents and args.wait_s > 0:
                with console.status("waiting for every agent to be discovered over mDNS"):
                    devices = lab.wait_for_agents(args.wait_s)
            console.print(hosts_table(lab.state, devices))
            console.print(f"[dim]{LATENCY_NOTE}[/]")
            console.print(
                f"lab [bold]{lab.plan.lab_id}[/] is up; state in {args.state_dir}. "
                "Ctrl-C here or `fedshard lab down` removes it."
            )
            _serve(lab)
        except Stopped:
            console.print("stopping the lab")
        except LabError as exc:
            console.print(f"[red]error:[/] {exc}")
            code = 1
        finally:
            _ignore_stop_signals()  # nothing may interrupt the teardown
            try:
                lab.down()
            except LabError as exc:
                console.print(f"[red]error:[/] {exc}")
                code = 1
    if code == 0:
        console.print(f"lab {lab.plan.lab_id} removed")
    return code


def run_down(args: argparse.Namespace) -> int:
    """Handler of ``lab down``: stop the owning ``lab up`` and remove what is left."""
    _logging()
    console = Console()
    try:
        if args.lab_id:
            teardown(args.lab_id)
            state = load_state(args.state_dir)
            if state is not None and state.plan.lab_id == args.lab_id:
                remove_state(args.state_dir)
            lab_id: str | None = args.lab_id
        else:
            lab_id = down_from_state(args.state_dir)
    except LabError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    console.print(f"lab {lab_id} removed" if lab_id else f"no lab in {args.state_dir}")
    return 0


def run_exec(args: argparse.Namespace) -> int:
    """Handler of ``lab exec HOST -- CMD``: the command's exit code."""
    console = Console(stderr=True)
    command, state_dir = _split_exec(args.command, args.state_dir)
    if not command:
        console.print("[red]error:[/] no command; try `fedshard lab exec h0 -- ip -br addr`")
        return 2
    try:
        state = load_state(state_dir)
        if state is None:
            console.print(f"[red]error:[/] no lab in {state_dir}")
            return 1
        node = state.plan.node(args.host)
    except LabError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    env = {
        **os.environ,
        "FEDSHARD_LAB_ID": state.plan.lab_id,
        "FEDSHARD_LAB_HOST": node.name,
        "FEDSHARD_LAB_ADDRESS": node.address,
    }
    proc = subprocess.Popen(state.plan.exec_argv(node.name, command), env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return proc.wait()


def _split_exec(words: list[str], state_dir: Path) -> tuple[list[str], Path]:
    """``[--state-dir D] -- CMD...`` after the host: the command, and the state dir."""
    if "--" not in words:
        return words, state_dir
    cut = words.index("--")
    options = argparse.ArgumentParser(prog="fedshard lab exec HOST", add_help=False)
    options.add_argument("--state-dir", type=Path, default=state_dir)
    return words[cut + 1 :], options.parse_args(words[:cut]).state_dir


def run_status(args: argparse.Namespace) -> int:
    """Handler of ``lab status``: 0 if a lab is up in the state dir, 1 if not."""
    console = Console()
    try:
        state = load_state(args.state_dir)
        present = set(lab_netns(state.plan.lab_id)) if state else set()
    except LabError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    if state is None:
        console.print(f"no lab in {args.state_dir}")
        return 1
    alive = {a.host: is_alive(a.process) for a in state.agents}
    if args.json:
        live = {"netns_present": sorted(present), "agents_alive": alive}
        console.print_json(data={"state": state.model_dump(mode="json"), "live": live})
        return 0
    console.print(hosts_table(state, [], present=present, alive=alive))
    console.print(f"[dim]{state.latency_note}[/]")
    return 0


def hosts_table(
    state: LabState,
    devices: list[dict[str, Any]],
    present: set[str] | None = None,
    alive: dict[str, bool] | None = None,
) -> Table:
    """The lab as a table: one row per host plus ``ctl``."""
    plan = state.plan
    table = Table(title=f"lab {plan.lab_id} ({plan.subnet}, {state.status})")
    for column in ("host", "namespace", "address", "Mbit/s", "latency ms", "memory", "agent"):
        table.add_column(column)
    found = {d["name"]: d for d in devices}
    ctl = plan.control
    table.add_row(ctl.name, _ns(ctl.netns, present), ctl.address, "-", "-", "-", "coordinator")
    pids = {a.host: a.process.pid for a in state.agents}
    for host in plan.hosts:
        agent = "-"
        if host.name in pids:
            agent = f"pid {pids[host.name]}"
            if host.name in found:
                agent += f", :{found[host.name]['control_port']} discovered"
            if alive is not None and not alive.get(host.name, False):
                agent += " [red](exited)[/]"
        rate = f"{host.bandwidth_mbps:g}" if host.bandwidth_mbps else "unshaped"
        table.add_row(
            host.name,
            _ns(host.netns, present),
            host.address,
            rate,
            f"{host.latency_ms:g}",
            f"{host.memory_bytes / 2**20:.0f} MiB",
            agent,
        )
    return table


def _ns(netns: str, present: set[str] | None) -> str:
    return netns if present is None or netns in present else f"{netns} [red](missing)[/]"


def _serve(lab: Lab) -> None:
    reported: set[str] = set()
    while True:
        time.sleep(1.0)
        for host in lab.dead_agents():
            if host not in reported:
                reported.add(host)
                log.warning("agent on %s exited:\n%s", host, lab.agent_log_tail(host))


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """Turn the first SIGINT/SIGTERM/SIGHUP into :class:`Stopped`; ignore later ones."""

    def handler(signum: int, frame: FrameType | None) -> None:
        _ignore_stop_signals()
        raise Stopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _ignore_stop_signals() -> None:
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
