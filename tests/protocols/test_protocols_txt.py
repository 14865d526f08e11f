"""mDNS TXT codec: round trips, the 255-byte entry limit, unknown keys, malformed values."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.errors import TxtRecordError
from protocols.profile import AgentState, Announcement, DeviceProfile
from protocols.txt import MAX_ENTRY_BYTES, decode_txt, encode_txt

hexes = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
profiles = st.builds(
    DeviceProfile,
    device_id=st.text(alphabet="0123456789abcdef", min_size=16, max_size=64),
    name=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,40}", fullmatch=True),
    memory_bytes=st.integers(0, 2**50),
    gflops=st.floats(min_value=1e-3, max_value=1e6, allow_nan=False),
    providers=st.lists(st.from_regex(r"[A-Za-z]{1,24}", fullmatch=True), max_size=4),
    control_port=st.integers(1, 65535),
    data_port=st.integers(1, 65535),
    cert_fingerprint=hexes,
    memory_gbps=st.none() | st.floats(min_value=1e-3, max_value=1e4, allow_nan=False),
    cache_bytes=st.none() | st.integers(0, 2**40),
    cache_gbps=st.none() | st.floats(min_value=1e-3, max_value=1e4, allow_nan=False),
    op_us=st.none() | st.floats(min_value=0, max_value=1e3, allow_nan=False),
    int4_rows_exact=st.none() | st.booleans(),
)
states = st.builds(
    AgentState,
    paired=st.booleans(),
    segment_sha256=st.none() | hexes,
    plan_version=st.integers(0, 2**32),
)


def _as_zeroconf(entries: dict[str, str]) -> dict[bytes, bytes | None]:
    return {k.encode(): v.encode() for k, v in entries.items()}


@given(profile=profiles, state=states)
@settings(max_examples=200, deadline=None)
def test_round_trip(profile: DeviceProfile, state: AgentState) -> None:
    announcement = Announcement(profile=profile, state=state)
    entries = encode_txt(announcement)
    assert all(len(k) + 1 + len(v.encode()) <= MAX_ENTRY_BYTES for k, v in entries.items())
    assert decode_txt(_as_zeroconf(entries)) == announcement
    assert decode_txt(entries) == announcement


def _sample() -> Announcement:
    return Announcement(
        profile=DeviceProfile(
            device_id="0123456789abcdef",
            name="laptop",
            memory_bytes=2 << 30,
            gflops=50.0,
            control_port=9000,
            data_port=9001,
            cert_fingerprint="a" * 64,
        )
    )


def test_unknown_keys_are_ignored() -> None:
    props = _as_zeroconf(encode_txt(_sample()))
    props[b"future-key"] = b"whatever"
    props[b"flag-without-value"] = None
    assert decode_txt(props) == _sample()


def test_roofs_travel_as_optional_keys_and_old_agents_parse_without_them() -> None:
    roofed = _sample().model_copy(
        update={
            "profile": _sample().profile.model_copy(
                update={"memory_gbps": 3.25, "cache_bytes": 16 << 20, "cache_gbps": 18.5}
            )
        }
    )
    entries = encode_txt(roofed)
    assert (entries["mbw"], entries["cache"], entries["cbw"]) == ("3.25", str(16 << 20), "18.5")
    assert "opus" not in entries
    assert decode_txt(entries) == roofed
    old = encode_txt(_sample())  # an agent from before the memory roof
    assert not {"mbw", "cbw", "cache", "opus"} & old.keys()
    assert decode_txt(old).profile.memory_gbps is None
    exact = _sample().profile.model_copy(update={"int4_rows_exact": False})
    assert encode_txt(Announcement(profile=exact))["i4x"] == "0"
    assert "i4x" not in old and decode_txt(old).profile.int4_rows_exact is None


def test_protocol_version_key_is_present() -> None:
    assert encode_txt(_sample())["pv"] == "1"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (b"mem", b"lots"),
        (b"mem", b"-5"),
        (b"gf", b"nan"),
        (b"gf", b"-1"),
        (b"mbw", b"0"),
        (b"mbw", b"inf"),
        (b"cache", b"-1"),
        (b"cp", b"70000"),
        (b"fp", b"not-hex"),
        (b"name", b"bad name with spaces"),
        (b"paired", b"yes"),
        (b"i4x", b"true"),
        (b"pv", b"\xff\xfe"),
    ],
)
def test_malformed_values_are_refused_with_a_typed_error(key: bytes, value: bytes) -> None:
    props = _as_zeroconf(encode_txt(_sample()))
    props[key] = value
    with pytest.raises(TxtRecordError):
        decode_txt(props)


def test_missing_required_key_is_refused() -> None:
    props = _as_zeroconf(encode_txt(_sample()))
    del props[b"fp"]
    with pytest.raises(TxtRecordError, match="fp"):
        decode_txt(props)


def test_an_entry_over_255_bytes_is_refused_when_encoding() -> None:
    profile = _sample().profile.model_copy(update={"providers": ["P" * 130, "Q" * 130]})
    with pytest.raises(TxtRecordError, match="prov"):
        encode_txt(Announcement(profile=profile))
