"""Device registry (unit) and zeroconf discovery with real advertiser processes on 127.0.0.1."""

from __future__ import annotations

from mdns_helpers import stop_advertiser

from coordinator.fleet.discovery import ZeroconfDiscovery
from coordinator.fleet.registry import DeviceRecord, DeviceRegistry
from protocols.profile import Announcement, DeviceProfile
from protocols.txt import encode_txt


def _announcement(name: str, fingerprint_char: str, port: int = 9000) -> Announcement:
    return Announcement(
        profile=DeviceProfile(
            device_id=fingerprint_char * 16,
            name=name,
            memory_bytes=1 << 30,
            gflops=10.0,
            control_port=port,
            data_port=port + 1,
            cert_fingerprint=fingerprint_char * 64,
        )
    )


def test_devices_are_keyed_by_fingerprint_and_an_impostor_cannot_take_a_name() -> None:
    ticks = iter(range(100))
    registry = DeviceRegistry(clock=lambda: float(next(ticks)))
    registry.announce(_announcement("nas", "a"), "127.0.0.1", "nas-a")
    registry.announce(_announcement("nas", "b"), "127.0.0.1", "nas-b")
    registry.announce(_announcement("nas", "a", port=9100), "127.0.0.1", "nas-a")
    devices = {d.fingerprint: d for d in registry.devices()}
    assert devices["a" * 64].impostor_of is None
    assert devices["a" * 64].announcement.profile.control_port == 9100
    assert devices["b" * 64].impostor_of == "a" * 64


def test_departure_marks_offline_and_a_return_keeps_first_seen() -> None:
    registry = DeviceRegistry()
    first = registry.announce(_announcement("sbc", "c"), "127.0.0.1", "sbc-svc")
    registry.depart("sbc-svc")
    assert registry.devices() == []
    assert registry.devices(online_only=False)[0].online is False
    again = registry.announce(_announcement("sbc", "c"), "127.0.0.1", "sbc-svc")
    assert again.first_seen == first.first_seen


def _names(devices: list[DeviceRecord]) -> set[str]:
    return {d.name for d in devices}


def test_real_agents_are_seen_joining_and_leaving_within_three_seconds(advertise) -> None:
    registry = DeviceRegistry()
    with ZeroconfDiscovery(registry, "127.0.0.1"):
        nas = advertise("nas-svc", 9000, encode_txt(_announcement("nas", "a")))
        advertise("sbc-svc", 9010, encode_txt(_announcement("sbc", "b", port=9010)))
        advertise("broken-svc", 9020, {"pv": "1", "mem": "lots"})
        assert registry.wait_for(lambda ds: _names(ds) == {"nas", "sbc"}, timeout=3.0)
        stop_advertiser(nas)
        assert registry.wait_for(lambda ds: _names(ds) == {"sbc"}, timeout=3.0)
    sbc = next(d for d in registry.devices() if d.name == "sbc")
    assert sbc.host == "127.0.0.1"
    assert sbc.announcement.profile.control_port == 9010
