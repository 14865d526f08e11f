"""Hostile input to every decoder in ``protocols``: only the package's typed errors come out.

``tests/protocols/test_protocols_fuzz.py`` throws random bytes at the frame and TXT decoders;
this file adds structured input (JSON-ish documents, valid documents with one node replaced or
removed) for the frame header, the manifest, the deploy body and envelope, ``DEVICES.json`` and the
planning problem, plus the cases a fuzzer rarely reaches by chance (deep nesting, huge numbers,
non-finite floats, oversized TXT records).
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.base import FrozenModel
from protocols.deploy import (
    DeployManifest,
    DeployRequest,
    Hop,
    decode_deploy_body,
    encode_deploy_body,
)
from protocols.devices import DeviceList
from protocols.errors import ProtocolError, SchemaError, TxtRecordError
from protocols.frames import MAGIC, PREFIX, FrameHeader, decode_frame, encode_frame, frame_length
from protocols.manifest import Manifest
from protocols.problem import PlanningProblem
from protocols.txt import MAX_RECORD_BYTES, MAX_TXT_ENTRIES, decode_txt

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
SHA = "ab" * 32

MANIFEST: dict[str, Any] = {
    "format": "fedshard.manifest/1",
    "model": {
        "name": "m",
        "sha256": SHA,
        "param_bytes": 10,
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}],
    },
    "objective": "throughput",
    "bottleneck_s": 0.5,
    "latency_s": 1.0,
    "segments": [
        {
            "index": i,
            "device": f"d{i}",
            "file": f"segment{i}.onnx",
            "sha256": SHA,
            "inputs": ["x"] if i == 0 else ["h"],
            "outputs": ["h"] if i == 0 else ["y"],
            "param_bytes": 5,
            "predicted_memory_bytes": 100,
            "predicted_compute_s": 0.25,
            "units": [i, i + 1],
        }
        for i in range(2)
    ],
}
PROBLEM: dict[str, Any] = {
    "name": "p",
    "input_bytes": 8,
    "queue_depth": 2,
    "units": [
        {"name": f"u{i}", "weight_bytes": 100, "out_bytes": 8, "compute_s": {"cpu": 0.1}}
        for i in range(3)
    ],
    "devices": [
        {"name": "a", "type": "cpu", "memory_bytes": 1000, "bandwidth_mbps": 100.0},
        {"name": "b", "type": "cpu", "memory_bytes": 1000, "bandwidth_mbps": 10.0},
    ],
    "links": [{"a": "a", "b": "b", "bandwidth_mbps": 50.0, "latency_ms": 1.0}],
    "shared_weights": [{"name": "emb", "bytes": 10, "units": [0, 2]}],
    "requester": {"links": [{"device": "b", "bandwidth_mbps": 5.0, "latency_ms": 2.0}]},
}
DEVICES: dict[str, Any] = {
    "devices": [
        {"name": "a", "memory_bytes": 1000, "gflops": 2.0, "bandwidth_mbps": 100.0},
        {"name": "b", "memory_bytes": 1000, "gflops": 4.0, "bandwidth_mbps": 100.0},
    ],
    "links": [{"a": "a", "b": "b", "bandwidth_mbps": 50.0}],
    "requester": {"links": [{"device": "a", "bandwidth_mbps": 20.0}]},
}


def _deploy_request() -> DeployRequest:
    segment = Manifest.from_obj(MANIFEST).segments[0]
    manifest = DeployManifest(
        deployment="m@1",
        plan_version=1,
        segment=segment,
        chain=[Hop(device=f"d{i}", host="127.0.0.1", data_port=9000 + i) for i in range(2)],
        forward=["h"],
        warmup_shapes={"x": [1, 4]},
    )
    return DeployRequest(
        manifest=manifest, signature_algorithm="ecdsa-p256-sha256", signature_hex="ab" * 36
    )


DEPLOY_ENVELOPE: dict[str, Any] = _deploy_request().model_dump(mode="json")
DEPLOY_BODY = encode_deploy_body(_deploy_request(), b"\x08\x07onnx", b"warm")
FRAME_HEADER: dict[str, Any] = {
    "request_id": "r1",
    "segment_index": 0,
    "plan_version": 1,
    "tensors": [{"name": "x", "dtype": "float32", "shape": [2, 4]}],
}

SCHEMAS: dict[str, tuple[type[FrozenModel], dict[str, Any]]] = {
    "manifest": (Manifest, MANIFEST),
    "problem": (PlanningProblem, PROBLEM),
    "devices": (DeviceList, DEVICES),
    "deploy-envelope": (DeployRequest, DEPLOY_ENVELOPE),
}

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["", "x", "float32", "throughput", SHA, "segment0.onnx", "-1", "1e999"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a node of a JSON document (the root is ``()``)."""
    found = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found += _paths(value, (*prefix, i))
    return found


def _mutated(doc: Any, path: tuple[Any, ...], value: Any, delete: bool) -> Any:
    """A copy of ``doc`` with the node at ``path`` replaced by ``value`` (or removed)."""
    if not path:
        return value
    copy = json.loads(json.dumps(doc))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return copy


def _typed_errors_only(call: Callable[[], object]) -> None:
    """Run ``call``; a ProtocolError is a fine answer, anything else fails the test."""
    with contextlib.suppress(ProtocolError):
        call()


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_seed_documents_are_valid(kind: str) -> None:
    model, doc = SCHEMAS[kind]
    assert model.from_json(_json_bytes(doc)).model_dump(mode="json") == model.from_obj(
        doc
    ).model_dump(mode="json")


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
@given(data=st.data())
@FUZZ
def test_mutated_documents_raise_only_schema_errors(kind: str, data: st.DataObject) -> None:
    model, doc = SCHEMAS[kind]
    path = data.draw(st.sampled_from(_paths(doc)))
    delete = bool(path) and not isinstance(path[-1], int) and data.draw(st.booleans())
    mutated = _mutated(doc, path, data.draw(json_values), delete)
    with contextlib.suppress(SchemaError):
        model.from_json(_json_bytes(mutated))
    with contextlib.suppress(SchemaError):
        model.from_obj(mutated)


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
@given(raw=st.binary(max_size=300) | json_values.map(_json_bytes))
@FUZZ
def test_arbitrary_bytes_and_json_raise_only_schema_errors(kind: str, raw: bytes) -> None:
    model, _ = SCHEMAS[kind]
    with contextlib.suppress(SchemaError):
        model.from_json(raw)


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        b'{"a":' * 100_000,
        b"\xff\xfe\x00",
        b"",
        b"null",
        b'"' + b"x" * 100_000,
    ],
    ids=["deep-list", "deep-object", "not-utf8", "empty", "null", "unterminated"],
)
def test_pathological_json_is_a_schema_error(kind: str, raw: bytes) -> None:
    model, _ = SCHEMAS[kind]
    with pytest.raises(SchemaError):
        model.from_json(raw)


@pytest.mark.parametrize(
    ("kind", "path"),
    [
        ("problem", ("units", 0, "compute_s", "cpu")),
        ("problem", ("devices", 1, "bandwidth_mbps")),
        ("problem", ("links", 0, "latency_ms")),
        ("problem", ("requester", "links", 0, "bandwidth_mbps")),
        ("devices", ("requester", "links", 0, "latency_ms")),
        ("devices", ("devices", 0, "gflops")),
        ("manifest", ("bottleneck_s",)),
        ("manifest", ("segments", 1, "predicted_compute_s")),
    ],
)
@pytest.mark.parametrize("value", ["Infinity", "NaN", "1e999"])
def test_non_finite_numbers_are_refused(kind: str, path: tuple[Any, ...], value: str) -> None:
    """A planning problem with an infinite compute time is nonsense, not a plan input."""
    model, doc = SCHEMAS[kind]
    marker = "__NUMBER__"
    text = json.dumps(_mutated(doc, path, marker, False)).replace(f'"{marker}"', value)
    with pytest.raises(SchemaError, match="finite"):
        model.from_json(text)


def test_huge_integers_are_refused_or_kept_exact() -> None:
    doc = _mutated(PROBLEM, ("devices", 0, "memory_bytes"), 10**400, False)
    problem = PlanningProblem.from_json(_json_bytes(doc))
    assert problem.devices[0].memory_bytes == 10**400


# ---- deploy body ---------------------------------------------------------------------------


@given(st.lists(st.tuples(st.integers(0, len(DEPLOY_BODY) - 1), st.integers(0, 255)), max_size=8))
@FUZZ
def test_mutated_deploy_body(flips: list[tuple[int, int]]) -> None:
    body = bytearray(DEPLOY_BODY)
    for pos, value in flips:
        body[pos] = value
    _typed_errors_only(lambda: decode_deploy_body(bytes(body)))


@given(st.integers(0, len(DEPLOY_BODY)), st.binary(max_size=32))
@FUZZ
def test_cut_or_extended_deploy_body(cut: int, tail: bytes) -> None:
    _typed_errors_only(lambda: decode_deploy_body(DEPLOY_BODY[:cut] + tail))


@given(
    envelope=json_values.map(_json_bytes) | st.binary(max_size=200),
    lengths=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)) | st.none(),
    rest=st.binary(max_size=64),
)
@FUZZ
def test_deploy_body_with_any_envelope_and_lengths(
    envelope: bytes, lengths: tuple[int, int] | None, rest: bytes
) -> None:
    env_len, warm_len = lengths if lengths is not None else (len(envelope), 0)
    body = struct.pack("<4sIQ", b"FSD1", env_len, warm_len) + envelope + rest
    _typed_errors_only(lambda: decode_deploy_body(body))


def test_deploy_body_round_trips_and_splits() -> None:
    request, segment, warmup = decode_deploy_body(DEPLOY_BODY)
    assert request == _deploy_request()
    assert bytes(segment) == b"\x08\x07onnx" and bytes(warmup) == b"warm"


# ---- frames: structured headers ------------------------------------------------------------


def _frame(header: bytes, payload: bytes) -> bytes:
    return PREFIX.pack(MAGIC, len(header), len(payload)) + header + payload


@given(data=st.data(), payload=st.binary(max_size=128))
@FUZZ
def test_frames_with_mutated_json_headers(data: st.DataObject, payload: bytes) -> None:
    path = data.draw(st.sampled_from(_paths(FRAME_HEADER)))
    header = _mutated(FRAME_HEADER, path, data.draw(json_values), False)
    _typed_errors_only(lambda: decode_frame(_frame(_json_bytes(header), payload), 1 << 20))


@given(
    shape=st.lists(st.integers(0, 2**70), max_size=9),
    dtype=st.sampled_from(["float32", "bool", "int64", "object", "<f4", "float128", "str"]),
    payload=st.binary(max_size=256),
)
@FUZZ
def test_frames_declaring_any_shape_and_dtype(shape: list[int], dtype: str, payload: bytes) -> None:
    """Huge or overflowing declared shapes never allocate: the byte count is checked first."""
    header = {"request_id": "r", "tensors": [{"name": "t", "dtype": dtype, "shape": shape}]}
    _typed_errors_only(lambda: decode_frame(_frame(_json_bytes(header), payload), 1 << 20))


@given(st.binary(min_size=16, max_size=16))
@FUZZ
def test_any_prefix_gives_a_length_or_a_typed_error(prefix: bytes) -> None:
    _typed_errors_only(lambda: frame_length(prefix, 1 << 20))


def test_a_valid_frame_still_decodes() -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    frame = decode_frame(encode_frame(FrameHeader(request_id="r1", plan_version=1), {"x": x}))
    np.testing.assert_array_equal(frame.tensors["x"], x)


# ---- TXT records ---------------------------------------------------------------------------


def test_an_entry_over_255_bytes_is_refused() -> None:
    """DNS-SD entries carry a one-byte length; a longer one is forged, not truncated."""
    props = {b"name": b"n" * 300}
    with pytest.raises(TxtRecordError, match="255"):
        decode_txt(props)


def test_an_oversized_record_is_refused_before_it_is_parsed() -> None:
    props = {f"k{i}".encode(): b"v" * 200 for i in range(MAX_RECORD_BYTES // 200 + 2)}
    with pytest.raises(TxtRecordError, match="bytes"):
        decode_txt(props)


def test_a_record_with_too_many_entries_is_refused() -> None:
    props = {f"{i}".encode(): None for i in range(MAX_TXT_ENTRIES + 1)}
    with pytest.raises(TxtRecordError, match="entries"):
        decode_txt(props)


@given(
    st.dictionaries(
        st.text(max_size=12) | st.binary(max_size=12),
        st.none() | st.text(max_size=300) | st.binary(max_size=300),
        max_size=40,
    )
)
@FUZZ
def test_txt_with_str_or_bytes_keys_and_long_values(props: dict[Any, Any]) -> None:
    _typed_errors_only(lambda: decode_txt(props))
