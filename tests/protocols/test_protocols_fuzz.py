"""Fuzzing the decoders: random and mutated bytes raise only the project's typed errors."""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.errors import ProtocolError
from protocols.frames import FrameHeader, decode_frame, encode_frame
from protocols.profile import AgentState, Announcement, DeviceProfile
from protocols.txt import decode_txt, encode_txt

SEED_FRAME = encode_frame(
    FrameHeader(request_id="req-1", session_id="s", segment_index=1, plan_version=3),
    {"hidden": np.ones((2, 3, 4), np.float32), "mask": np.ones((2, 3), np.int64)},
)
SEED_TXT = encode_txt(
    Announcement(
        profile=DeviceProfile(
            device_id="ab" * 8,
            name="nas",
            memory_bytes=1 << 30,
            gflops=12.5,
            control_port=8471,
            data_port=8472,
            cert_fingerprint="cd" * 32,
        ),
        state=AgentState(paired=True, segment_sha256="ef" * 32, plan_version=2),
    )
)
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_frame_or_typed_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_frame(data, max_frame_bytes=1 << 20)


def _decode_txt_or_typed_error(props: dict[bytes, bytes | None]) -> None:
    with contextlib.suppress(ProtocolError):
        decode_txt(props)


@given(st.binary(max_size=512))
@FUZZ
def test_random_bytes_as_a_frame(data: bytes) -> None:
    _decode_frame_or_typed_error(data)


@given(st.binary(max_size=200))
@FUZZ
def test_random_bytes_behind_a_valid_magic(data: bytes) -> None:
    _decode_frame_or_typed_error(b"FSF1" + data)


@given(st.lists(st.tuples(st.integers(0, len(SEED_FRAME) - 1), st.integers(0, 255)), max_size=8))
@FUZZ
def test_mutated_valid_frame(flips: list[tuple[int, int]]) -> None:
    data = bytearray(SEED_FRAME)
    for pos, value in flips:
        data[pos] = value
    _decode_frame_or_typed_error(bytes(data))


@given(st.integers(0, len(SEED_FRAME)), st.binary(max_size=16))
@FUZZ
def test_cut_or_extended_valid_frame(cut: int, tail: bytes) -> None:
    _decode_frame_or_typed_error(SEED_FRAME[:cut] + tail)


@given(st.dictionaries(st.binary(max_size=12), st.none() | st.binary(max_size=80), max_size=16))
@FUZZ
def test_random_txt_records(props: dict[bytes, bytes | None]) -> None:
    _decode_txt_or_typed_error(props)


@given(
    st.sampled_from(sorted(SEED_TXT)),
    st.none() | st.binary(max_size=80) | st.sampled_from([b"", b"-1", b"nan", b"inf", b"1e999"]),
)
@FUZZ
def test_one_txt_value_replaced(key: str, value: bytes | None) -> None:
    props: dict[bytes, bytes | None] = {k.encode(): v.encode() for k, v in SEED_TXT.items()}
    props[key.encode()] = value
    _decode_txt_or_typed_error(props)
