"""Activation frame codec: round trips, zero-copy decoding, and typed errors on bad bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocols.errors import (
    FrameError,
    FrameTooLargeError,
    MalformedFrameError,
    TensorSpecError,
    TruncatedFrameError,
    WireErrorCode,
)
from protocols.frames import (
    DTYPES,
    PREFIX,
    PREFIX_BYTES,
    FrameHeader,
    FrameKind,
    decode_frame,
    encode_frame,
    encode_frame_parts,
    frame_length,
)

tensor_names = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20
)
arrays = st.sampled_from(sorted(DTYPES)).flatmap(
    lambda name: hnp.arrays(
        dtype=DTYPES[name],
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    )
)
headers = st.builds(
    FrameHeader,
    request_id=st.text(min_size=1, max_size=40),
    session_id=st.none() | st.text(min_size=1, max_size=40),
    segment_index=st.integers(0, 1000),
    plan_version=st.integers(0, 2**40),
)


@given(header=headers, tensors=st.dictionaries(tensor_names, arrays, max_size=5))
@settings(max_examples=200, deadline=None)
def test_round_trip_keeps_header_and_tensors(header: FrameHeader, tensors: dict) -> None:
    frame = decode_frame(encode_frame(header, tensors))
    assert frame.header.request_id == header.request_id
    assert frame.header.session_id == header.session_id
    assert frame.header.segment_index == header.segment_index
    assert frame.header.plan_version == header.plan_version
    assert list(frame.tensors) == list(tensors)
    for name, value in tensors.items():
        got = frame.tensors[name]
        assert got.dtype == value.dtype.newbyteorder("<") or got.dtype == value.dtype
        assert got.shape == value.shape
        np.testing.assert_array_equal(got, value)


def test_decoded_arrays_are_read_only_views_of_the_received_buffer() -> None:
    data = bytearray(encode_frame(FrameHeader(request_id="r"), {"x": np.arange(1024.0)}))
    frame = decode_frame(data)
    x = frame.tensors["x"]
    assert not x.flags.writeable
    assert not x.flags.owndata
    assert np.shares_memory(x, np.frombuffer(data, dtype=np.uint8))


def test_scatter_gather_parts_do_not_copy_tensor_bytes() -> None:
    x = np.arange(4096, dtype=np.float32)
    parts = encode_frame_parts(FrameHeader(request_id="r"), {"x": x})
    shared = [p for p in parts if isinstance(p, memoryview) and np.shares_memory(np.asarray(p), x)]
    assert len(shared) == 1


def test_big_endian_and_strided_inputs_are_sent_as_little_endian_contiguous() -> None:
    x = np.arange(12, dtype=">i8").reshape(3, 4)[:, ::2]
    got = decode_frame(encode_frame(FrameHeader(request_id="r"), {"x": x})).tensors["x"]
    assert got.dtype == np.dtype("<i8")
    np.testing.assert_array_equal(got, x)


def test_error_replies_carry_a_message_and_no_tensors() -> None:
    header = FrameHeader(
        request_id="r",
        kind=FrameKind.ERROR,
        error_code=WireErrorCode.INPUT_MISMATCH,
        error="bad input",
    )
    frame = decode_frame(encode_frame(header, {}))
    assert frame.header.error == "bad input" and frame.header.failed
    assert frame.header.error_code is WireErrorCode.INPUT_MISMATCH
    assert frame.tensors == {}


@pytest.mark.parametrize(
    "value", [np.array(["a"]), np.zeros(2, dtype=np.complex64), np.zeros(2, dtype=object)]
)
def test_encoding_refuses_dtypes_outside_the_whitelist(value: np.ndarray) -> None:
    with pytest.raises(TensorSpecError):
        encode_frame(FrameHeader(request_id="r"), {"x": value})


def test_frame_over_the_limit_is_refused_from_its_prefix_alone() -> None:
    data = encode_frame(FrameHeader(request_id="r"), {"x": np.zeros(1024, np.float32)})
    with pytest.raises(FrameTooLargeError):
        frame_length(data[:PREFIX_BYTES], max_frame_bytes=1024)
    with pytest.raises(FrameTooLargeError):
        decode_frame(data, max_frame_bytes=1024)


def test_truncated_and_padded_frames_are_refused() -> None:
    data = encode_frame(FrameHeader(request_id="r"), {"x": np.ones(10, np.float32)})
    with pytest.raises(TruncatedFrameError):
        decode_frame(data[:-1])
    with pytest.raises(TruncatedFrameError):
        decode_frame(data[:5])
    with pytest.raises(MalformedFrameError):
        decode_frame(data + b"\0")


def _frame_with_header(header: bytes, payload: bytes = b"") -> bytes:
    return PREFIX.pack(b"FSF1", len(header), len(payload)) + header + payload


@pytest.mark.parametrize(
    ("header", "payload", "error"),
    [
        (b"not json", b"", MalformedFrameError),
        (b"[1, 2]", b"", MalformedFrameError),
        (b'{"request_id": "r", "surprise": 1}', b"", MalformedFrameError),
        (
            b'{"request_id":"r","tensors":[{"name":"x","dtype":"complex64","shape":[1]}]}',
            bytes(64),
            TensorSpecError,
        ),
        (
            b'{"request_id":"r","tensors":[{"name":"x","dtype":"float32","shape":[1000]}]}',
            bytes(64),
            TensorSpecError,
        ),
        (
            b'{"request_id":"r","tensors":[{"name":"x","dtype":"float32","shape":[-1]}]}',
            b"",
            MalformedFrameError,
        ),
        (
            b'{"request_id":"r","tensors":[{"name":"x","dtype":"float32","shape":[1]},'
            b'{"name":"x","dtype":"float32","shape":[1]}]}',
            bytes(128),
            MalformedFrameError,
        ),
        (
            b'{"request_id":"r","tensors":[{"name":"x","dtype":"float32","shape":[1]}]}',
            bytes(128),
            MalformedFrameError,
        ),
        (
            b'{"request_id":"r","tensors":[{"name":"x","dtype":"float32","shape":['
            + b"9," * 8
            + b"9]}]}",
            b"",
            MalformedFrameError,
        ),
    ],
)
def test_hand_made_bad_frames_get_their_typed_error(
    header: bytes, payload: bytes, error: type[FrameError]
) -> None:
    with pytest.raises(error):
        decode_frame(_frame_with_header(header, payload))


def test_huge_declared_shapes_do_not_overflow_or_allocate() -> None:
    big = 2**62
    header = b'{"request_id":"r","tensors":[{"name":"x","dtype":"float64","shape":[%d,%d]}]}' % (
        big,
        big,
    )
    with pytest.raises(TensorSpecError):
        decode_frame(_frame_with_header(header, bytes(64)))


def test_bad_magic_is_refused() -> None:
    data = bytearray(encode_frame(FrameHeader(request_id="r"), {}))
    data[:4] = b"XXXX"
    with pytest.raises(MalformedFrameError):
        decode_frame(data)


def test_prefix_length_fields_are_little_endian_u32_and_u64() -> None:
    data = encode_frame(FrameHeader(request_id="r"), {"x": np.zeros(3, np.uint8)})
    magic, header_len, payload_len = struct.unpack_from("<4sIQ", data)
    assert magic == b"FSF1"
    assert len(data) == PREFIX_BYTES + header_len + payload_len
    assert payload_len == 64
