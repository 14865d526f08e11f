"""Typed wire errors: frame kinds and error codes round-trip, bad combinations are refused, and
an agent's exception arrives at the coordinator as the error class it always meant."""

from __future__ import annotations

import contextlib
import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import errors as coord
from coordinator.transport.wire_errors import REMOTE, remote_error
from edge_agent import errors as agent
from edge_agent.net.wire_errors import CODES, CONTROL_CODES, code_of, control_code_of, error_header
from protocols.deploy import ErrorReply
from protocols.errors import (
    ControlErrorCode,
    FrameTooLargeError,
    MalformedFrameError,
    ProtocolError,
    SchemaError,
    TensorSpecError,
    TruncatedFrameError,
    WireErrorCode,
)
from protocols.frames import MAGIC, PREFIX, FrameHeader, FrameKind, decode_frame, encode_frame

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
messages = st.text(max_size=200)
error_headers = st.builds(
    FrameHeader,
    request_id=st.text(min_size=1, max_size=20),
    segment_index=st.integers(0, 64),
    kind=st.just(FrameKind.ERROR),
    error_code=st.sampled_from(list(WireErrorCode)),
    error=st.none() | messages,
)
other_headers = st.builds(
    FrameHeader,
    request_id=st.text(min_size=1, max_size=20),
    kind=st.sampled_from([FrameKind.DATA, FrameKind.RELEASE]),
)


def _raw_frame(header: dict[str, object]) -> bytes:
    body = json.dumps(header).encode()
    return PREFIX.pack(MAGIC, len(body), 0) + body


@FUZZ
@given(error_headers | other_headers)
def test_kinds_and_codes_round_trip(header: FrameHeader) -> None:
    assert decode_frame(encode_frame(header, {})).header == header


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "error"},
        {"kind": "data", "error_code": "internal"},
        {"kind": "release", "error": "release"},
        {"error": "an error message on a data frame"},
        {"kind": "error", "error_code": "no_such_code"},
        {"kind": "gossip"},
        {
            "kind": "error",
            "error_code": "internal",
            "tensors": [{"name": "x", "dtype": "uint8", "shape": [0]}],
        },
        {"kind": "release", "tensors": [{"name": "x", "dtype": "uint8", "shape": [0]}]},
    ],
    ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items())[:40],
)
def test_kind_code_and_message_must_agree(fields: dict[str, object]) -> None:
    with pytest.raises(MalformedFrameError):
        decode_frame(_raw_frame({"request_id": "r", **fields}))


@FUZZ
@given(
    kind=st.text(max_size=12) | st.sampled_from([k.value for k in FrameKind]),
    code=st.none() | st.text(max_size=20) | st.sampled_from([c.value for c in WireErrorCode]),
    error=st.none() | messages | st.integers(),
)
def test_random_kind_and_code_fields_raise_only_typed_errors(
    kind: str, code: str | None, error: object
) -> None:
    with contextlib.suppress(ProtocolError):
        header = decode_frame(
            _raw_frame({"request_id": "r", "kind": kind, "error_code": code, "error": error})
        ).header
        assert (header.kind is FrameKind.ERROR) == (header.error_code is not None)


AGENT_TO_COORDINATOR: list[tuple[Exception, type[coord.CoordinatorError]]] = [
    (agent.InputMismatchError("x has the wrong shape"), coord.RequestError),
    (agent.ExecutionError("onnxruntime failed"), coord.RequestError),
    (TensorSpecError("dtype complex64"), coord.RequestError),
    (agent.ContextLengthError("past 2048 tokens"), coord.RequestError),
    (agent.SessionLimitError("all 8 slots are taken"), coord.CapacityError),
    (agent.SessionStateError("no session s1"), coord.ChainBrokenError),
    (agent.LinkError("a2 is unreachable"), coord.ChainBrokenError),
    (agent.NoSegmentError("no segment for plan 3"), coord.NotServableError),
    (agent.RequestError("request id already claimed"), coord.NotServableError),
    (agent.PeerRejectedError("expected device 'a0'"), coord.NotServableError),
    (TruncatedFrameError("12 bytes short"), coord.NotServableError),
    (FrameTooLargeError("over 256 MiB"), coord.NotServableError),
    (RuntimeError("a bug"), coord.NotServableError),
]


@pytest.mark.parametrize(
    ("raised", "expected"), AGENT_TO_COORDINATOR, ids=lambda x: type(x).__name__
)
def test_an_agent_error_arrives_as_its_coordinator_error(
    raised: Exception, expected: type[coord.CoordinatorError]
) -> None:
    request = FrameHeader(request_id="r", plan_version=2, segment_index=1)
    sent = decode_frame(encode_frame(error_header(request, raised), {})).header
    assert sent.kind is FrameKind.ERROR and sent.error == str(raised)
    assert (sent.request_id, sent.plan_version, sent.segment_index) == ("r", 2, 1)
    got = remote_error(sent)
    assert type(got) is expected, got
    assert str(raised) in str(got) and type(raised).__name__ not in str(got)
    if isinstance(got, coord.CapacityError):
        assert got.retry_after_s > 0


def test_every_code_has_a_meaning_on_the_coordinator_and_a_source_on_the_agent() -> None:
    assert set(REMOTE) == set(WireErrorCode)
    produced = {code for _, code in CODES} | {code_of(RuntimeError())}
    assert produced == set(WireErrorCode)
    kinds = [kind for kind, _ in CODES]
    for i, kind in enumerate(kinds):  # most specific first: nothing shadowed
        assert not any(issubclass(kind, earlier) for earlier in kinds[:i]), kind


def test_an_error_frame_carries_no_tensors_even_from_a_request_that_did() -> None:
    request = FrameHeader(request_id="r")
    frame = decode_frame(encode_frame(request, {"x": np.ones(3, np.float32)}))
    reply = decode_frame(encode_frame(error_header(frame.header, agent.LinkError("down")), {}))
    assert reply.header.tensors == [] and reply.tensors == {}
    assert reply.header.failure() == "link_down: down"


def test_a_prefix_is_still_checked_before_the_header() -> None:
    too_long = PREFIX.pack(MAGIC, 10, 0) + b"{}"
    with pytest.raises(TruncatedFrameError):
        decode_frame(too_long)
    assert struct.calcsize("<4sIQ") == PREFIX.size


# ------------------------------------------------------------------- the control plane's codes


def test_every_refusal_of_the_agent_has_its_own_control_code() -> None:
    """The control plane's table is complete and unambiguous: every ``DeployError`` subclass
    the agent raises has its own code, and a class name is never a code."""
    leaves = agent.DeployError.__subclasses__()
    codes = {control_code_of(kind("x")) for kind in leaves}
    assert len(codes) == len(leaves) and ControlErrorCode.REFUSED not in codes
    assert control_code_of(agent.DeployError("x")) is ControlErrorCode.REFUSED
    assert control_code_of(agent.PairingError("x")) is ControlErrorCode.PAIRING
    assert control_code_of(MalformedFrameError("x")) is ControlErrorCode.BAD_REQUEST
    assert all(kind.__name__ != code for kind, code in CONTROL_CODES)


@FUZZ
@given(st.sampled_from(list(ControlErrorCode)), messages)
def test_error_replies_round_trip_and_class_names_are_refused(
    code: ControlErrorCode, message: str
) -> None:
    reply = ErrorReply(error=code, message=message)
    assert ErrorReply.from_json(reply.model_dump_json().encode()) == reply
    with pytest.raises(SchemaError):
        ErrorReply.from_json(json.dumps({"error": "BudgetError", "message": message}).encode())
