"""Integration: real labs (network namespaces on a bridge, tbf, mDNS, agents). Needs root.

Every lab is removed in a fixture or ``finally`` even when a test fails, and the module ends by
checking that none of its labs left a namespace behind and nothing appeared in the machine's own
namespace.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.lab import cli
from devtools.lab.errors import LabCommandError
from devtools.lab.executor import lab_netns, list_netns, run_command, unavailable_reason
from devtools.lab.lab import Lab, agents_available
from devtools.lab.plan import CONTROL, new_lab_id
from devtools.lab.procs import is_alive
from devtools.lab.spec import LabSpec
from devtools.lab.state import load_state

PY = sys.executable


pytestmark = [
    pytest.mark.skipif(bool(unavailable_reason()), reason=unavailable_reason() or "n/a"),
    pytest.mark.timeout(90),
]
LAB_IDS: list[str] = []


def _root_view() -> tuple[set[str], str]:
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True)
    addrs = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in links.stdout.splitlines()}, addrs.stdout


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After the module: no namespace of any lab made here, no lab interface on the root side."""
    links_before, _ = _root_view()
    yield
    ours = [ns for ns in list_netns() if any(ns.startswith(f"fs-{i}-") for i in LAB_IDS)]
    links_after, addrs_after = _root_view()
    assert ours == [], f"namespaces left behind: {ours}"
    assert not {n for n in links_after - links_before if n.startswith(("v", "br0", "eth0@"))}
    assert "10.77." not in addrs_after


def _lab(spec: LabSpec, state_dir: Path) -> Lab:
    lab = Lab(spec, state_dir, lab_id=new_lab_id())
    LAB_IDS.append(lab.plan.lab_id)
    return lab


def _probe(lab: Lab, host: str, *args: str, timeout: float = 30) -> Any:
    """Run a probe to completion inside ``host``; its JSON result."""
    argv = lab.exec_argv(host, [PY, "-m", "devtools.lab.probe", *args])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.stdout.strip(), done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _serve(lab: Lab, host: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    """Start a serving probe in ``host``; returns it once it printed its ready line."""
    proc = lab.popen(
        host,
        [PY, "-m", "devtools.lab.probe", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "no output"
    ready: str = json.loads(line)["ready"]
    return proc, ready


@pytest.fixture(scope="module")
def net_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """Three hosts without agents: h0 unshaped, h1 at 50 Mbit/s, h2 at 20 Mbit/s."""
    spec = LabSpec.build(3, bandwidth_mbps="none,50,20", latency_ms="0,2,10", agents=False)
    lab = _lab(spec, tmp_path_factory.mktemp("netlab"))
    with lab:
        yield lab
    assert not lab_netns(lab.plan.lab_id)


def test_hosts_reach_each_other_over_tcp_and_nothing_else(net_lab: Lab) -> None:
    servers = {}
    try:
        for host in net_lab.plan.hosts:
            servers[host.name] = _serve(net_lab, host.name, "echo-server", "--bind", host.address)
        for host in net_lab.plan.hosts:
            targets = [ep for name, (_, ep) in servers.items() if name != host.name]
            results = _probe(net_lab, host.name, "connect", *(f"--to={t}" for t in targets))
            assert [r["ok"] for r in results] == [True, True], results
            assert {r["from"] for r in results} == {host.address}
        # the coordinator's namespace reaches every host too
        results = _probe(net_lab, CONTROL, "connect", *(f"--to={ep}" for _, ep in servers.values()))
        assert all(r["ok"] for r in results), results
        # no route out of the lab: any address outside it is unreachable from a host
        outside = _probe(net_lab, "h0", "connect", "--to=198.51.100.1:9", "--timeout=2")
        assert outside[0]["ok"] is False and "unreachable" in outside[0]["error"]
    finally:
        for proc, _ in servers.values():
            proc.kill()
            proc.communicate()


ADVERTISE = r"""
import hashlib, socket, sys
from zeroconf import IPVersion, ServiceInfo, Zeroconf
from protocols.constants import SERVICE_TYPE
from protocols.profile import Announcement, DeviceProfile
from protocols.txt import encode_txt
name, address, memory = sys.argv[1], sys.argv[2], int(sys.argv[3])
digest = hashlib.sha256(name.encode()).hexdigest()
profile = DeviceProfile(device_id=digest[:16], name=name, memory_bytes=memory, gflops=1.0,
                        control_port=7000, data_port=7001, cert_fingerprint=digest)
info = ServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", addresses=[socket.inet_aton(address)],
                   port=7000, properties=encode_txt(Announcement(profile=profile)),
                   server=f"{name}.local.")
zc = Zeroconf(interfaces=[address], ip_version=IPVersion.V4Only)
zc.register_service(info)
print('{"ready": "%s"}' % name, flush=True)
sys.stdin.read()
zc.unregister_service(info)
zc.close()
"""


def test_mdns_across_the_bridge(net_lab: Lab) -> None:
    advertisers = []
    try:
        for host, memory in (("h0", 1 << 20), ("h1", 2 << 20)):
            address = net_lab.plan.node(host).address
            proc = net_lab.popen(
                host,
                [PY, "-c", ADVERTISE, f"adv-{host}", address, str(memory)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            advertisers.append(proc)
            assert proc.stdout is not None and "ready" in proc.stdout.readline()
        h2 = net_lab.plan.node("h2").address
        result = _probe(net_lab, "h2", "browse", f"--interface={h2}", "--expect=2", "--timeout=20")
        assert result["found"], result
        seen = {d["name"]: (d["host"], d["memory_bytes"]) for d in result["devices"]}
        assert seen == {"adv-h0": ("10.77.0.1", 1 << 20), "adv-h1": ("10.77.0.2", 2 << 20)}
    finally:
        for proc in advertisers:
            proc.communicate(input="", timeout=10)


def _rate(lab: Lab, sender: str, receiver: str, seconds: float) -> float:
    address = lab.plan.node(receiver).address
    sink, endpoint = _serve(lab, receiver, "sink", "--bind", address)
    try:
        _probe(lab, sender, "send", f"--to={endpoint}", f"--seconds={seconds}")
        out, _ = sink.communicate(timeout=30)
    finally:
        sink.kill()
        sink.wait()
    result = json.loads(out.strip().splitlines()[-1])
    rate: float = result["mbps"]
    return rate


def test_tbf_shapes_each_hosts_link_both_ways(net_lab: Lab) -> None:
    into_h2 = _rate(net_lab, "h0", "h2", 2.0)
    out_of_h2 = _rate(net_lab, "h2", "h0", 2.0)
    into_h1 = _rate(net_lab, "h0", "h1", 2.0)
    unshaped = _rate(net_lab, "h0", CONTROL, 1.0)
    rates = f"into h2 {into_h2:.1f}, out of h2 {out_of_h2:.1f}, into h1 {into_h1:.1f}, "
    rates += f"unshaped {unshaped:.0f} Mbit/s"
    assert 0.5 * 20 <= into_h2 <= 1.3 * 20, rates
    assert 0.5 * 20 <= out_of_h2 <= 1.3 * 20, rates
    assert 0.5 * 50 <= into_h1 <= 1.3 * 50, rates
    assert unshaped > 3 * 50, rates


def test_state_file_records_latency_for_the_application(net_lab: Lab) -> None:
    state = load_state(net_lab.state_dir)
    assert state is not None and state.status == "ready"
    assert [h.latency_ms for h in state.plan.hosts] == [0, 2, 10]
    assert "netem" in state.latency_note
    link = next(x for x in state.plan.links() if (x["a"], x["b"]) == ("h1", "h2"))
    assert link == {"a": "h1", "b": "h2", "bandwidth_mbps": 20, "latency_ms": 12}


# --- teardown ------------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["lab", *argv])


def _start_lab_up(state_dir: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    lab_id = new_lab_id()
    LAB_IDS.append(lab_id)
    argv = [PY, "-m", "devtools.lab", "up", "2", "--no-agents", "--lab-id", lab_id]
    proc = subprocess.Popen(
        [*argv, "--state-dir", str(state_dir), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        state = load_state(state_dir)
        if state is not None and state.status == "ready":
            return proc, lab_id
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise AssertionError("lab up did not get ready")


def _assert_gone(lab_id: str, state_dir: Path) -> None:
    assert lab_netns(lab_id) == []
    assert load_state(state_dir) is None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_lab_up_removes_everything(tmp_path: Path, sig: signal.Signals) -> None:
    proc, lab_id = _start_lab_up(tmp_path)
    try:
        assert len(lab_netns(lab_id)) == 3
        proc.send_signal(sig)
        assert proc.wait(30) == 0
        _assert_gone(lab_id, tmp_path)
    finally:
        proc.kill()
        proc.wait()
        cli.run_down(_args("down", "--lab-id", lab_id, "--state-dir", str(tmp_path)))


def test_lab_down_from_another_process_stops_lab_up_and_every_process(tmp_path: Path) -> None:
    proc, lab_id = _start_lab_up(tmp_path)
    stray = None
    try:
        state_dir = ["--state-dir", str(tmp_path)]
        stray = subprocess.Popen(
            [PY, "-m", "devtools.lab", "exec", "h1", *state_dir, "--", "sleep", "300"]
        )
        assert cli.run_status(_args("status", *state_dir)) == 0
        assert cli.run_exec(_args("exec", "h0", *state_dir, "--", "ip", "-br", "addr")) == 0
        assert cli.run_exec(_args("exec", "h0", *state_dir, "--", "false")) == 1
        assert stray.poll() is None
        assert cli.run_down(_args("down", *state_dir)) == 0
        assert proc.wait(10) == 0
        assert stray.wait(10) != 0
        _assert_gone(lab_id, tmp_path)
        assert cli.run_down(_args("down", *state_dir)) == 0  # idempotent
    finally:
        for p in (proc, stray):
            if p is not None:
                p.kill()
                p.wait()
        cli.run_down(_args("down", "--lab-id", lab_id, "--state-dir", str(tmp_path)))


def test_lab_down_cleans_up_after_a_killed_lab_up(tmp_path: Path) -> None:
    proc, lab_id = _start_lab_up(tmp_path)
    try:
        state = load_state(tmp_path)
        assert state is not None and state.supervisor is not None
        proc.kill()  # SIGKILL: lab up gets no chance to clean up
        proc.wait()
        assert len(lab_netns(lab_id)) == 3
        assert not is_alive(state.supervisor)
        # a new lab in the same state dir is refused while the old one's namespaces exist
        assert cli.run_up(_args("up", "1", "--no-agents", "--state-dir", str(tmp_path))) == 1
        assert cli.run_down(_args("down", "--state-dir", str(tmp_path))) == 0
        _assert_gone(lab_id, tmp_path)
    finally:
        cli.run_down(_args("down", "--lab-id", lab_id, "--state-dir", str(tmp_path)))


def test_a_failure_half_way_through_up_removes_what_was_made(tmp_path: Path) -> None:
    lab = _lab(LabSpec.build(3, bandwidth_mbps="10", agents=False), tmp_path)
    squatter = lab.plan.hosts[2].netns
    run_command(["ip", "netns", "add", squatter])  # makes `ip netns add` fail for h2
    try:
        with pytest.raises(LabCommandError, match="File exists"):
            lab.up()
        _assert_gone(lab.plan.lab_id, tmp_path)
    finally:
        cli.run_down(_args("down", "--lab-id", lab.plan.lab_id, "--state-dir", str(tmp_path)))


# --- agents ----------------------------------------------------------------------------------


@pytest.mark.skipif(not agents_available(PY), reason="the edge agent is not installed")
def test_agents_in_three_hosts_are_discovered_from_the_fourth(tmp_path: Path) -> None:
    spec = LabSpec.build(3, bandwidth_mbps="100,50,20", memory="64MiB,128MiB,256MiB")
    lab = _lab(spec, tmp_path)
    with lab:
        devices = lab.wait_for_agents(timeout_s=60)
        seen = {d["name"]: (d["host"], d["memory_bytes"]) for d in devices}
        assert seen == {
            "h0": ("10.77.0.1", 64 << 20),
            "h1": ("10.77.0.2", 128 << 20),
            "h2": ("10.77.0.3", 256 << 20),
        }
        agents = list(lab.state.agents)
        assert len(agents) == 3 and all(is_alive(a.process) for a in agents)
    assert not any(is_alive(a.process) for a in agents)
    assert "withdrew" in (tmp_path / "h0" / "agent.log").read_text()
    _assert_gone(lab.plan.lab_id, tmp_path)
