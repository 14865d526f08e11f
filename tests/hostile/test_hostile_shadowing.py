"""Hostile mDNS, second round: a rogue announcing a paired device's own instance name.

The first round's fix kept a rogue from *taking* a paired device's place; it still hid it: a
second key announcing the device's mDNS instance name took the paired record offline (both
models failed over), and the rogue's goodbye, which removes the pointer record both share, left
the real device offline until it announced again (about 6 minutes). Now the paired record stays
online while the conflict lasts (authenticated liveness decides whether it is used) and is
confirmed again within one discovery interval after the rogue leaves.

Unit tests drive :class:`DeviceRegistry` and :class:`Liveness` with fakes; the last test runs
real zeroconf advertisers on 127.0.0.1 (the rogue skips conflict probing, as a rogue would).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

import pytest
from coordinator_helpers import wait_for

from coordinator.config import Timeouts
from coordinator.fleet import registry as registry_module
from coordinator.fleet.discovery import DISCOVERY_INTERVAL_S, GOODBYE_S, ZeroconfDiscovery
from coordinator.fleet.liveness import Liveness
from coordinator.fleet.registry import DeviceRecord, DeviceRegistry
from protocols.deploy import AgentStatus
from protocols.profile import AgentState, Announcement, DeviceProfile
from protocols.txt import encode_txt

pytestmark = pytest.mark.timeout(120)
REAL, ROGUE = "a" * 64, "b" * 64

CONFIRM_S = Timeouts().mdns_confirm_s
UNPAIRED_TTL_S = Timeouts().unpaired_forget_s


def _announcement(name: str, fingerprint: str, port: int, paired: bool = True) -> Announcement:
    return Announcement(
        profile=DeviceProfile(
            device_id=fingerprint[:16],
            name=name,
            memory_bytes=1 << 30,
            gflops=10.0,
            control_port=port,
            data_port=port + 1,
            cert_fingerprint=fingerprint,
        ),
        state=AgentState(paired=paired),
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _registry(book: dict[str, str]) -> tuple[DeviceRegistry, Clock]:
    clock = Clock()
    return DeviceRegistry(clock=clock, paired_fingerprint=book.get), clock


def _online(registry: DeviceRegistry) -> dict[str, str]:
    return {r.fingerprint: r.host for r in registry.devices()}


def test_a_rogue_on_the_paired_instance_name_never_hides_the_device() -> None:
    registry, clock = _registry({"nas": REAL})
    registry.announce(_announcement("nas", REAL, 9000), "10.0.0.2", "nas-svc")
    registry.announce(_announcement("nas", ROGUE, 9100), "10.0.0.66", "nas-svc")
    # the conflict: both listed, the paired record online at its own address, the rogue flagged
    assert _online(registry) == {REAL: "10.0.0.2", ROGUE: "10.0.0.66"}
    record = registry.get(REAL)
    assert record is not None and record.contested_by == ROGUE
    rogue = registry.get(ROGUE)
    assert rogue is not None and rogue.impostor_of == REAL
    # zeroconf may resolve the shared name with the rogue's address and the device's TXT
    registry.announce(_announcement("nas", REAL, 9000), "10.0.0.66", "nas-svc")
    assert _online(registry)[REAL] == "10.0.0.2"
    # the rogue's goodbye removes the name: mDNS cannot say whose; the device stays, unconfirmed
    assert registry.depart("nas-svc") is True
    assert _online(registry) == {REAL: "10.0.0.2"}
    assert registry.unconfirmed() == ["nas-svc"]
    clock.now += CONFIRM_S / 2
    registry.expire()
    assert REAL in _online(registry)
    # asked again, the device answers: confirmed, and a later expiry changes nothing
    registry.announce(_announcement("nas", REAL, 9000), "10.0.0.2", "nas-svc")
    assert registry.unconfirmed() == []
    clock.now += 10 * CONFIRM_S
    registry.expire()
    assert _online(registry) == {REAL: "10.0.0.2"}
    # no conflict any more: a goodbye now is the device's own
    assert registry.depart("nas-svc") is False
    assert _online(registry) == {}


def test_an_unconfirmed_device_that_does_not_answer_goes_offline() -> None:
    registry, clock = _registry({"nas": REAL})
    registry.announce(_announcement("nas", REAL, 9000), "10.0.0.2", "nas-svc")
    registry.announce(_announcement("nas", ROGUE, 9100), "10.0.0.66", "nas-svc")
    assert registry.depart("nas-svc") is True
    clock.now += CONFIRM_S
    registry.expire()
    assert _online(registry) == {}
    assert registry.unconfirmed() == []


def test_a_renewed_certificate_on_the_same_instance_name_replaces_the_old_record() -> None:
    book = {"nas": REAL}
    registry, _ = _registry(book)
    registry.announce(_announcement("nas", REAL, 9000), "10.0.0.2", "nas-svc")
    book["nas"] = ROGUE  # the book's certificate for nas is now the renewed one
    registry.announce(_announcement("nas", ROGUE, 9000), "10.0.0.2", "nas-svc")
    assert _online(registry) == {ROGUE: "10.0.0.2"}


class Listener:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def device_lost(self, name: str, reason: str) -> None:
        self.events.append(("lost", name))

    def device_back(self, name: str) -> None:
        self.events.append(("back", name))

    def device_status(self, name: str, status: AgentStatus, asked_at: float) -> None:
        """Not needed here."""


def test_no_failover_while_the_shadowed_device_answers() -> None:
    book = {"nas": REAL}
    registry, _ = _registry(book)

    def trusted() -> list[DeviceRecord]:
        return [r for r in registry.devices() if book.get(r.name) == r.fingerprint]

    def ping(record: DeviceRecord, timeout: float) -> AgentStatus:
        assert record.host == "10.0.0.2"  # the device's own address, never the rogue's
        return AgentStatus(
            name=record.name,
            device_id=record.fingerprint[:16],
            memory_budget_bytes=1 << 30,
            memory_committed_bytes=0,
            resident_memory_bytes=1 << 20,
            gflops=10.0,
            paired=True,
        )

    listener = Listener()
    liveness = Liveness(trusted, lambda: {"nas"}, ping, listener)
    try:
        registry.announce(_announcement("nas", REAL, 9000), "10.0.0.2", "nas-svc")
        liveness.tick()
        registry.announce(_announcement("nas", ROGUE, 9100), "10.0.0.66", "nas-svc")
        liveness.tick()
        registry.depart("nas-svc")
        liveness.tick()
        registry.announce(_announcement("nas", REAL, 9000), "10.0.0.2", "nas-svc")
        liveness.tick()
    finally:
        liveness.stop()
    assert listener.events == []
    assert liveness.alive("nas")


def test_unpaired_records_expire_and_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "MAX_UNPAIRED", 4)
    registry, clock = _registry({"nas": REAL})
    registry.announce(_announcement("nas", REAL, 9000), "10.0.0.2", "nas-svc")
    rogues = [secrets.token_hex(32) for _ in range(6)]
    for i, fp in enumerate(rogues[:4]):
        registry.announce(_announcement(f"r{i}", fp, 9100, paired=False), "10.0.0.9", f"r{i}")
    # full of online unpaired records: a fifth is refused, never a paired one evicted
    registry.announce(_announcement("r4", rogues[4], 9100, paired=False), "10.0.0.9", "r4")
    listed = {r.fingerprint for r in registry.devices(online_only=False)}
    assert listed == {REAL, *rogues[:4]}
    # one goes offline: the next new one takes its place
    registry.depart("r0")
    registry.announce(_announcement("r5", rogues[5], 9100, paired=False), "10.0.0.9", "r5")
    listed = {r.fingerprint for r in registry.devices(online_only=False)}
    assert listed == {REAL, *rogues[1:4], rogues[5]}
    # offline unpaired records are forgotten after the TTL; offline paired ones are kept
    for name in ("r1", "r2", "r3", "r5", "nas-svc"):
        registry.depart(name)
    clock.now += UNPAIRED_TTL_S
    registry.expire()
    assert [r.fingerprint for r in registry.devices(online_only=False)] == [REAL]


ADVERTISER = textwrap.dedent(
    """
    import socket, sys
    from zeroconf import IPVersion, ServiceInfo, Zeroconf
    name, port = sys.argv[1], int(sys.argv[2])
    txt = dict(a.split("=", 1) for a in sys.argv[3:])
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    info = ServiceInfo("_fedshard._tcp.local.", f"{name}._fedshard._tcp.local.",
                       addresses=[socket.inet_aton("127.0.0.1")], port=port, properties=txt)
    # a rogue skips conflict probing: cooperating_responders=True
    zc.register_service(info, cooperating_responders=True)
    print("up", flush=True)
    try:
        sys.stdin.read()
    finally:
        zc.unregister_service(info)
        zc.close()
    """
)


Advertise = Callable[[str, int, dict[str, str]], subprocess.Popen[str]]


@pytest.fixture
def advertise() -> Iterator[Advertise]:
    started: list[subprocess.Popen[str]] = []

    def start(service: str, port: int, txt: dict[str, str]) -> subprocess.Popen[str]:
        args = [f"{k}={v}" for k, v in txt.items()]
        proc = subprocess.Popen(
            [sys.executable, "-c", ADVERTISER, service, str(port), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def _withdraw(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=10)


def test_a_real_rogue_announcer_on_the_instance_name_hides_nothing(
    advertise: Advertise,
) -> None:
    name = f"nas-{secrets.token_hex(4)}"
    real, rogue = secrets.token_hex(32), secrets.token_hex(32)
    book = {name: real}
    registry = DeviceRegistry(paired_fingerprint=book.get)
    trusted_samples: list[bool] = []

    def real_trusted() -> bool:
        record = registry.get(real)
        trusted = record is not None and record.online
        trusted_samples.append(trusted)
        return trusted

    with ZeroconfDiscovery(registry, "127.0.0.1"):
        device = advertise(name, 9000, encode_txt(_announcement(name, real, 9000)))
        assert registry.wait_for(lambda ds: real in {d.fingerprint for d in ds}, 10.0)
        impostor = advertise(name, 9100, encode_txt(_announcement(name, rogue, 9100)))
        assert registry.wait_for(lambda ds: rogue in {d.fingerprint for d in ds}, 10.0)
        # the conflict lasts: the device stays online at its own port
        trusted_samples.clear()
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            assert real_trusted()
            time.sleep(0.1)
        record = registry.get(real)
        assert record is not None and record.announcement.profile.control_port == 9000
        # the rogue withdraws: its record goes, the device stays and is confirmed again
        _withdraw(impostor)
        assert wait_for(lambda: not _rogue_online(registry, rogue), 10.0)
        bound = GOODBYE_S + 2 * DISCOVERY_INTERVAL_S + 2.0  # + one resolve
        assert wait_for(lambda: registry.unconfirmed() == [] and real_trusted(), bound)
        assert all(trusted_samples), "the device was hidden"
        # the browser knows the device's name again: its own goodbye is seen
        _withdraw(device)
        assert wait_for(lambda: not real_trusted(), 10.0)


def _rogue_online(registry: DeviceRegistry, fingerprint: str) -> bool:
    record = registry.get(fingerprint)
    return record is not None and record.online
