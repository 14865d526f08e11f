"""Unit tests of the lab's planning layer, state file, executor and CLI plumbing (no root)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from coordinator.errors import CoordinatorError
from devtools.lab import cli
from devtools.lab.errors import (
    LabCommandError,
    LabError,
    LabSpecError,
    LabStateError,
    LabTeardownError,
)
from devtools.lab.executor import apply, list_netns, teardown
from devtools.lab.plan import IFNAMSIZ, Command, lab_prefix, new_lab_id, plan_lab, tbf_args
from devtools.lab.procs import is_alive, process_ref, terminate
from devtools.lab.spec import LabSpec, parse_size
from devtools.lab.state import LabState, load_state, remove_state, save_state, state_path

LAB_ID = "abc123"


def _plan(count: int = 3, **kwargs: str):  # type: ignore[no-untyped-def]
    return plan_lab(LabSpec.build(count, **kwargs), LAB_ID)  # type: ignore[arg-type]


# --- spec --------------------------------------------------------------------------------


def test_one_value_applies_to_every_host_and_lists_are_per_host() -> None:
    spec = LabSpec.build(3, bandwidth_mbps="100,50,20", latency_ms="5", memory="64MiB")
    assert [h.bandwidth_mbps for h in spec.hosts] == [100, 50, 20]
    assert [h.latency_ms for h in spec.hosts] == [5, 5, 5]
    assert [h.memory_bytes for h in spec.hosts] == [64 << 20] * 3
    assert [h.name for h in spec.hosts] == ["h0", "h1", "h2"]


def test_defaults_are_unshaped_zero_latency_256mib_with_agents() -> None:
    spec = LabSpec.build(2)
    assert all(h.bandwidth_mbps is None and h.latency_ms == 0 for h in spec.hosts)
    assert all(h.memory_bytes == 256 << 20 for h in spec.hosts)
    assert spec.agents and spec.subnet == "10.77.0.0/24"


def test_none_means_unshaped_for_one_host() -> None:
    spec = LabSpec.build(2, bandwidth_mbps="none,20")
    assert [h.bandwidth_mbps for h in spec.hosts] == [None, 20]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bandwidth_mbps": "100,50"}, "one value or 3"),
        ({"bandwidth_mbps": "fast"}, "not a number"),
        ({"bandwidth_mbps": "-5"}, "positive"),
        ({"latency_ms": "-1"}, "negative"),
        ({"latency_ms": "nan"}, "not finite"),
        ({"memory": "lots"}, "as a size"),
        ({"names": "a,b"}, "2 names for 3"),
        ({"names": "a,a,b"}, "unique"),
        ({"names": "a,ctl,b"}, "reserved"),
        ({"names": "a,B!,c"}, "name"),
        ({"subnet": "192.168.1.0/24"}, "10.77.0.0/16"),
        ({"subnet": "10.77.0.0/30"}, "/29"),
    ],
)
def test_bad_specs_are_refused_with_a_reason(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(LabSpecError, match=message):
        LabSpec.build(3, **kwargs)  # type: ignore[arg-type]


def test_host_count_limits() -> None:
    with pytest.raises(LabSpecError, match="1 to"):
        LabSpec.build(0)
    with pytest.raises(LabSpecError, match="room"):
        LabSpec.build(6, subnet="10.77.3.0/29")
    assert len(LabSpec.build(5, subnet="10.77.3.0/29").hosts) == 5


def test_errors_derive_from_coordinator_error() -> None:
    assert issubclass(LabError, CoordinatorError)
    assert issubclass(LabCommandError, LabError)
    err = LabCommandError(["ip", "x"], 2, "boom\n", "doing x")
    assert "ip x" in str(err) and "doing x" in str(err) and err.stderr == "boom"


def test_parse_size_units() -> None:
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(LabSpecError):
        parse_size("0")


# --- plan --------------------------------------------------------------------------------


def test_addresses_names_and_interfaces() -> None:
    plan = _plan(3)
    assert [h.address for h in plan.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert plan.control.address == "10.77.0.254"
    assert plan.netns_names() == ("fs-abc123-h0", "fs-abc123-h1", "fs-abc123-h2", "fs-abc123-ctl")
    assert {h.interface for h in plan.hosts} == {"eth0"}
    assert [h.bridge_port for h in plan.hosts] == ["v0", "v1", "v2"]


def test_every_command_stays_inside_the_labs_namespaces() -> None:
    """The guarantee that the lab never touches the machine's own interfaces."""
    plan = _plan(200, subnet="10.77.0.0/16", bandwidth_mbps="10")
    ours = set(plan.netns_names())
    net = ipaddress.IPv4Network("10.77.0.0/16")
    for command in plan.setup_commands():
        argv = command.argv
        assert argv[0] in ("ip", "tc")
        if argv[1:3] == ("netns", "add"):
            assert argv[3] in ours
            continue
        assert argv[1] == "-n" and argv[2] in ours, argv
        if "peer" in argv:  # the veth's other end is created straight in a lab namespace
            assert argv[argv.index("netns") + 1] in ours
        if "addr" in argv:
            assert ipaddress.IPv4Interface(argv[argv.index("add") + 1]).ip in net
        if argv[3:5] == ("link", "add"):  # new interface names fit the kernel's limit
            names = [argv[5]] + ([argv[argv.index("name") + 1]] if "peer" in argv else [])
            assert all(len(name) <= IFNAMSIZ for name in names), names


def test_bridge_comes_first_and_shaping_is_both_ways_for_shaped_hosts_only() -> None:
    plan = _plan(2, bandwidth_mbps="none,20")
    argvs = [c.argv for c in plan.setup_commands()]
    assert argvs[0] == ("ip", "netns", "add", "fs-abc123-ctl")
    tbf = [a for a in argvs if a[0] == "tc"]
    assert len(tbf) == 2
    assert tbf[0][:8] == ("tc", "-n", "fs-abc123-h1", "qdisc", "add", "dev", "eth0", "root")
    assert tbf[1][:8] == ("tc", "-n", "fs-abc123-ctl", "qdisc", "add", "dev", "v1", "root")
    assert "20000kbit" in tbf[0]


def test_tbf_burst_scales_with_rate() -> None:
    slow, fast = tbf_args(1), tbf_args(1000)
    assert int(slow[slow.index("burst") + 1]) == 32_000
    assert int(fast[fast.index("burst") + 1]) == 625_000
    assert fast[fast.index("rate") + 1] == "1000000kbit"


def test_links_take_the_slower_rate_and_sum_latencies() -> None:
    plan = _plan(3, bandwidth_mbps="100,none,20", latency_ms="1,2,5")
    links = {(x["a"], x["b"]): x for x in plan.links()}
    assert links[("h0", "h1")] == {"a": "h0", "b": "h1", "bandwidth_mbps": 100, "latency_ms": 3}
    assert links[("h0", "h2")]["bandwidth_mbps"] == 20
    assert links[("h1", "h2")]["latency_ms"] == 7
    assert _plan(2).links()[0]["bandwidth_mbps"] is None


def test_exec_and_agent_command_lines() -> None:
    plan = _plan(2, memory="64MiB")
    assert plan.exec_argv("ctl", ["true"]) == ["ip", "netns", "exec", "fs-abc123-ctl", "true"]
    argv = plan.agent_argv(plan.hosts[1], "/py", Path("/s/h1"))
    assert argv[:4] == ["ip", "netns", "exec", "fs-abc123-h1"]
    assert argv[4:8] == ["/py", "-m", "edge_agent", "agent"]
    assert argv[argv.index("--interface") + 1] == "10.77.0.2"
    assert argv[argv.index("--memory") + 1] == str(64 << 20)
    assert argv[argv.index("--threads") + 1] == "1"  # the lab's hosts share the machine
    with pytest.raises(LabSpecError, match="no host 'h9'"):
        plan.node("h9")


def test_lab_ids() -> None:
    assert len(new_lab_id()) == 6 and new_lab_id() != new_lab_id()
    assert lab_prefix("00ff") == "fs-00ff-"
    for bad in ("", "xyz123", "abc", "0123456789"):
        with pytest.raises(LabSpecError):
            lab_prefix(bad)


# --- state -------------------------------------------------------------------------------


def test_state_round_trip_and_errors(tmp_path: Path) -> None:
    assert load_state(tmp_path) is None
    state = LabState(plan=_plan(2), status="creating", supervisor=process_ref(os.getpid()))
    save_state(state, tmp_path)
    assert load_state(tmp_path) == state
    assert "netem" in state.latency_note
    with pytest.raises(ValueError):  # frozen
        state.status = "ready"  # type: ignore[misc]
    state_path(tmp_path).write_text('{"format": "nope"}')
    with pytest.raises(LabStateError):
        load_state(tmp_path)
    remove_state(tmp_path)
    remove_state(tmp_path)  # idempotent
    assert load_state(tmp_path) is None


# --- processes ---------------------------------------------------------------------------


def test_process_refs_tell_processes_apart_and_terminate_stops_them() -> None:
    me = process_ref(os.getpid())
    assert me is not None and is_alive(me)
    assert not is_alive(me.model_copy(update={"start_ticks": me.start_ticks + 1}))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ref = process_ref(child.pid)
        assert ref is not None
        assert terminate([ref], grace_s=5) == []
        assert child.wait(5) != 0
        assert process_ref(child.pid) is None
    finally:
        child.kill()
        child.wait()


# --- executor with a fake runner --------------------------------------------------------


class FakeRunner:
    """Records command lines; pretends namespaces exist; fails where told."""

    def __init__(self, namespaces: Sequence[str] = (), fail_on: str = "") -> None:
        self.calls: list[tuple[str, ...]] = []
        self.namespaces = list(namespaces)
        self.fail_on = fail_on

    def __call__(self, argv: Sequence[str], what: str = "") -> str:
        argv = tuple(argv)
        self.calls.append(argv)
        if self.fail_on and self.fail_on in argv:
            raise LabCommandError(argv, 1, "injected failure", what)
        if argv == ("ip", "netns", "list"):
            return "".join(f"{ns} (id: {i})\n" for i, ns in enumerate(self.namespaces))
        if argv[:3] == ("ip", "netns", "del"):
            self.namespaces.remove(argv[3])
        return ""


def test_apply_stops_at_the_first_failure() -> None:
    run = FakeRunner(fail_on="two")
    commands = [Command(("ip", w), w) for w in ("one", "two", "three")]
    with pytest.raises(LabCommandError, match="two"):
        apply(commands, run)
    assert run.calls == [("ip", "one"), ("ip", "two")]


def test_list_netns_reads_both_output_forms() -> None:
    assert list_netns(lambda argv, what="": "a (id: 0)\nb\n\n") == ["a", "b"]


def test_teardown_removes_only_this_labs_namespaces_hosts_first() -> None:
    others = ["fs-ffff00-h0", "fs-abc1234-h0", "mine"]
    run = FakeRunner([*others, "fs-abc123-ctl", "fs-abc123-h1", "fs-abc123-h0"])
    teardown(LAB_ID, run=run)
    deleted = [c[3] for c in run.calls if c[:3] == ("ip", "netns", "del")]
    assert deleted == ["fs-abc123-h0", "fs-abc123-h1", "fs-abc123-ctl"]
    assert run.namespaces == others
    teardown(LAB_ID, run=run)  # idempotent: nothing left, nothing to do


def test_teardown_tries_everything_and_reports_every_failure() -> None:
    run = FakeRunner(["fs-abc123-h0", "fs-abc123-ctl"], fail_on="fs-abc123-h0")
    with pytest.raises(LabTeardownError) as info:
        teardown(LAB_ID, run=run)
    assert ("ip", "netns", "del", "fs-abc123-ctl") in run.calls
    assert any("still there" in str(e) for e in info.value.errors)


# --- CLI plumbing ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedshard")
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_parses_every_subcommand(tmp_path: Path) -> None:
    parser = _parser()
    up = parser.parse_args(["lab", "up", "3", "--bandwidth-mbps", "100,50,20", "--no-agents"])
    assert up.run is cli.run_up and up.hosts == 3 and up.no_agents
    assert parser.parse_args(["lab", "down"]).run is cli.run_down
    assert parser.parse_args(["lab", "status", "--json"]).run is cli.run_status
    ex = parser.parse_args(["lab", "exec", "h0", "--state-dir", str(tmp_path), "--", "ip", "a"])
    assert ex.run is cli.run_exec
    assert cli._split_exec(ex.command, ex.state_dir) == (["ip", "a"], tmp_path)
    assert cli._split_exec(["ip", "a"], tmp_path) == (["ip", "a"], tmp_path)


def test_cli_handlers_without_a_lab(tmp_path: Path) -> None:
    parser = _parser()
    state = ["--state-dir", str(tmp_path)]
    assert cli.run_status(parser.parse_args(["lab", "status", *state])) == 1
    assert cli.run_exec(parser.parse_args(["lab", "exec", "h0", *state, "--", "true"])) == 1
    assert cli.run_exec(parser.parse_args(["lab", "exec", "h0", *state, "--"])) == 2
    assert cli.run_up(parser.parse_args(["lab", "up", "2", "--memory", "x", *state])) == 2


def test_unavailable_reason_says_why_in_plain_words() -> None:
    import os
    import shutil

    from devtools.lab.errors import LabCommandError
    from devtools.lab.executor import unavailable_reason

    def broken(argv: Sequence[str], what: str = "") -> str:
        raise LabCommandError(argv, 1, "Operation not permitted", what)

    def working(argv: Sequence[str], what: str = "") -> str:
        return ""

    if os.geteuid() != 0:
        assert "root" in unavailable_reason(working)
    elif shutil.which("ip") and shutil.which("tc"):
        assert unavailable_reason(working) == ""
        assert "`ip netns` does not work here" in unavailable_reason(broken)
