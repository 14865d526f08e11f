"""The fleet's and trust's waits are configuration too (:class:`~coordinator.config.Timeouts`,
:class:`~coordinator.config.Retries`): their defaults are the constants they replaced, and the
liveness monitor, the trust exchanges and the device registry wait what they are given."""

from __future__ import annotations

from pathlib import Path

from coordinator.config import CoordinatorConfig, Retries, Timeouts
from coordinator.errors import AgentError
from coordinator.fleet.liveness import Liveness
from coordinator.fleet.registry import DeviceRecord, DeviceRegistry
from coordinator.trust.exchanges import Exchanges
from protocols.deploy import AgentStatus
from protocols.profile import AgentState, Announcement, DeviceProfile


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _announcement(name: str, fingerprint: str) -> Announcement:
    profile = DeviceProfile(
        name=name,
        device_id=fingerprint[:16],
        cert_fingerprint=fingerprint,
        memory_bytes=1 << 30,
        gflops=1.0,
        control_port=1,
        data_port=2,
    )
    return Announcement(profile=profile, state=AgentState(paired=True))


def test_the_defaults_are_the_constants_they_replace() -> None:
    config = CoordinatorConfig(Path("state"))
    waits, retries = config.timeouts, config.retries
    assert (waits.ping_s, waits.busy_grace_s, waits.startup_grace_s, waits.settle_s) == (
        1.0,
        60.0,
        5.0,
        2.0,
    )
    assert (waits.link_probe_s, waits.link_reply_s, waits.mdns_resolve_s) == (60.0, 10.0, 2.0)
    assert (waits.trust_delivery_s, waits.mdns_confirm_s, waits.unpaired_forget_s) == (
        10.0,
        3.0,
        600.0,
    )
    assert (retries.ping_interval_s, retries.ping_misses, retries.trust_poll_s) == (0.5, 2, 0.5)
    assert (
        retries.renewal_retry_s,
        retries.exchange_retry_s,
        retries.exchange_max_backoff_s,
    ) == (5.0, 5.0, 60.0)


def test_liveness_pings_misses_and_settles_as_configured() -> None:
    clock, asked, up = Clock(), [], {"a": True}
    events: list[tuple[str, str]] = []
    record = DeviceRecord(_announcement("a", "1" * 64), "127.0.0.1", "a._svc", 0.0, 0.0)

    def ping(device: DeviceRecord, timeout: float) -> AgentStatus:
        asked.append(timeout)
        if not up[device.name]:
            raise AgentError("timed out")
        return AgentStatus(
            name=device.name,
            device_id="0" * 32,
            memory_budget_bytes=1 << 30,
            memory_committed_bytes=0,
            resident_memory_bytes=0,
            gflops=1.0,
            paired=True,
        )

    class Listener:
        def device_lost(self, name: str, reason: str) -> None:
            events.append(("lost", name))

        def device_back(self, name: str) -> None:
            events.append(("back", name))

        def device_status(self, name: str, status: AgentStatus, asked_at: float) -> None:
            pass

    waits = Timeouts(ping_s=0.25, settle_s=7.0)
    live = Liveness(
        lambda: [record],
        set,
        ping,
        Listener(),
        clock,
        timeouts=waits,
        retries=Retries(ping_misses=3),
    )
    try:
        up["a"] = False
        live.tick()
        live.tick()
        assert events == []  # two misses of three
        live.tick()
        assert events == [("lost", "a")]
        up["a"] = True
        live.tick()
        clock.now += 6.0
        live.tick()
        assert events == [("lost", "a")]  # answering, not settled for 7 s yet
        clock.now += 1.0
        live.tick()
        assert events[-1] == ("back", "a")
        assert set(asked) == {0.25}
    finally:
        live.stop()


def test_trust_exchanges_back_off_as_configured() -> None:
    clock = Clock()
    pool = Exchanges(clock, Retries(exchange_retry_s=2.0, exchange_max_backoff_s=3.0))
    endpoint = ("127.0.0.1", 9)

    def failing() -> None:
        raise AgentError("refused")

    try:
        for backoff in (2.0, 3.0, 3.0):  # doubled, then capped
            assert pool.start(endpoint, failing, lambda result: None)
            assert pool.wait_idle(5.0)
            clock.now += backoff - 0.5
            assert not pool.ready(endpoint)
            clock.now += 0.5
            assert pool.ready(endpoint)
    finally:
        pool.close()


def test_the_registry_confirms_a_contested_name_within_the_configured_window() -> None:
    clock, real, rogue = Clock(), "a" * 64, "b" * 64
    registry = DeviceRegistry(
        clock=clock, paired_fingerprint={"nas": real}.get, timeouts=Timeouts(mdns_confirm_s=10.0)
    )
    registry.announce(_announcement("nas", real), "10.0.0.2", "nas-svc")
    registry.announce(_announcement("nas", rogue), "10.0.0.66", "nas-svc")
    assert registry.depart("nas-svc") is True
    clock.now += 9.0
    registry.expire()
    assert [r.fingerprint for r in registry.devices()] == [real]  # the default 3 s has passed
    clock.now += 1.0
    registry.expire()
    assert registry.devices() == []
