"""Unit tests of the edge agent's pieces, without processes or sockets."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from agent_fakes import CHAIN, segment_store
from agent_helpers import TestCA, manifest_for, tiny_chain

from edge_agent.config import AgentConfig, RuntimeConfig, parse_size, usable_cores
from edge_agent.errors import (
    BudgetError,
    ConfigError,
    InputMismatchError,
    IntegrityError,
    SegmentLoadError,
    SignatureError,
    WrongTargetError,
)
from edge_agent.profile.microbench import load_or_measure
from edge_agent.protobuf.writer import matmul_model_bytes
from edge_agent.runtime.checks import InputSpec, check_tensors
from edge_agent.trust.identity import load_identity, verify_signature
from protocols.deploy import (
    DeployRequest,
    decode_deploy_body,
    encode_deploy_body,
    signing_bytes,
)
from protocols.errors import SchemaError


def test_parse_size() -> None:
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_check_tensors_accepts_and_splits_passthrough() -> None:
    specs = [InputSpec("h", "float32", ("batch", 16))]
    h = np.zeros((2, 16), np.float32)
    x = np.zeros((2, 16), np.float32)
    feeds, carried = check_tensors(specs, {"h": h, "x": x}, ["x"])
    assert list(feeds) == ["h"] and list(carried) == ["x"]


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({}, "missing input"),
        ({"h": np.zeros((2, 16), np.float64)}, "expects float32"),
        ({"h": np.zeros((2, 4, 16), np.float32)}, "rank"),
        ({"h": np.zeros((2, 15), np.float32)}, "axis 1"),
        ({"h": np.zeros((2, 16), np.float32), "zz": np.zeros(1, np.float32)}, "unexpected"),
    ],
)
def test_check_tensors_refuses(tensors: dict[str, np.ndarray], message: str) -> None:
    specs = [InputSpec("h", "float32", ("batch", 16))]
    with pytest.raises(InputMismatchError, match=message):
        check_tensors(specs, tensors, [])


def test_check_tensors_symbolic_dims_agree() -> None:
    specs = [InputSpec("a", "int64", ("b", "s")), InputSpec("m", "int64", ("b", "s"))]
    with pytest.raises(InputMismatchError, match="dimension 's'"):
        check_tensors(specs, {"a": np.zeros((1, 8), np.int64), "m": np.zeros((1, 9), np.int64)}, [])


def test_microbench_model_is_valid_onnx_and_correct() -> None:
    data = matmul_model_bytes(8, 2)
    onnx.checker.check_model(onnx.load_from_string(data))
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
    w = np.eye(8, dtype=np.float32) * 2
    np.testing.assert_allclose(session.run(None, {"x": x, "w": w})[0], x @ w @ w, rtol=1e-6)


def test_profile_is_cached_and_remeasured_on_request(tmp_path: Path) -> None:
    runtime = RuntimeConfig()
    first = load_or_measure(tmp_path, runtime)
    assert (tmp_path / "profile.json").exists()
    assert load_or_measure(tmp_path, runtime) == first
    again = load_or_measure(tmp_path, runtime, remeasure=True)
    assert again.gflops > 0
    assert again.measured_at >= first.measured_at
    assert first.int4_rows_exact is not None and "int4_rows_exact" not in first.roofs()


def test_the_int4_row_probe_says_what_this_cpu_computes() -> None:
    """The agent's probe (a 256-wide chain at 1, 2 and 5 rows) agrees with another 4-bit
    product on this CPU (2048 wide, 1 and 3 rows): exact on AVX-512, not on AVX2."""
    from edge_agent.profile.gemvbench import gemv_model_bytes, measure_int4_rows_exact

    exact = measure_int4_rows_exact(RuntimeConfig())
    session = ort.InferenceSession(gemv_model_bytes(count=1, rows="rows"))
    x = np.random.default_rng(5).standard_normal((3, 2048), dtype=np.float32)
    alone, in_pass = (session.run(None, {"x": x[:n]})[0][0] for n in (1, 3))
    np.testing.assert_allclose(alone, in_pass, rtol=1e-3, atol=1e-3)  # the same product
    assert exact == bool(np.array_equal(alone, in_pass))


def test_signing_bytes_are_canonical_and_body_round_trips() -> None:
    seg = tiny_chain()[0]
    manifest = manifest_for(0, seg, CHAIN)
    same = type(manifest).from_json(manifest.model_dump_json(indent=4))
    assert signing_bytes(manifest) == signing_bytes(same)
    assert signing_bytes(manifest).startswith(b"fedshard.deploy/1\n{")
    request = DeployRequest(manifest=manifest, signature_algorithm="ed25519", signature_hex="ab")
    decoded, rest, warm = decode_deploy_body(encode_deploy_body(request, seg, b"frame"))
    assert decoded == request and bytes(rest) == seg and bytes(warm) == b"frame"
    with pytest.raises(SchemaError):
        decode_deploy_body(b"FSD1\xff\xff\xff\x00" + bytes(8) + b"{}")


@pytest.mark.parametrize("algorithm", ["ecdsa-p256-sha256", "ed25519"])
def test_signatures(tmp_path: Path, algorithm: str) -> None:
    ca = TestCA(tmp_path, algorithm)
    manifest = manifest_for(0, tiny_chain()[0], CHAIN)
    request = ca.sign(manifest)
    key = ca.cert.public_key()
    verify_signature(key, algorithm, bytes.fromhex(request.signature_hex), signing_bytes(manifest))  # type: ignore[arg-type]
    tampered = manifest.model_copy(update={"plan_version": 2})
    with pytest.raises(SignatureError):
        verify_signature(
            key, algorithm, bytes.fromhex(request.signature_hex), signing_bytes(tampered)
        )  # type: ignore[arg-type]
    other = "ed25519" if algorithm != "ed25519" else "ecdsa-p256-sha256"
    with pytest.raises(SignatureError, match="does not match"):
        verify_signature(key, other, b"x", signing_bytes(manifest))  # type: ignore[arg-type]


def test_identity_checks_name_and_issuer(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    other = TestCA(tmp_path / "other")
    cert, key = ca.issue("a0")
    from edge_agent.config import TlsFiles

    ok = load_identity(
        AgentConfig("a0", 1 << 20, tmp_path / "s", tls=TlsFiles(ca.ca_path, cert, key))
    )
    assert ok.paired and len(ok.device_id) == 32
    with pytest.raises(ConfigError, match="not issued to device"):
        load_identity(
            AgentConfig("a1", 1 << 20, tmp_path / "s", tls=TlsFiles(ca.ca_path, cert, key))
        )
    with pytest.raises(ConfigError, match="was not issued by"):
        load_identity(
            AgentConfig("a0", 1 << 20, tmp_path / "s", tls=TlsFiles(other.ca_path, cert, key))
        )
    unpaired = load_identity(AgentConfig("a0", 1 << 20, tmp_path / "u"))
    assert not unpaired.paired
    assert (tmp_path / "u" / "agent_key.pem").stat().st_mode & 0o777 == 0o600
    assert load_identity(AgentConfig("a0", 1 << 20, tmp_path / "u")).device_id == unpaired.device_id


def test_store_deploys_and_refuses(tmp_path: Path) -> None:
    ca = TestCA(tmp_path)
    store = segment_store(ca)
    seg = tiny_chain()[0]
    good = ca.sign(manifest_for(0, seg, CHAIN))
    bad = bytearray(seg)
    bad[-1] ^= 1
    with pytest.raises(IntegrityError):
        store.deploy(good, bytes(bad))
    forged = good.model_copy(update={"signature_hex": "00" * 70})
    with pytest.raises(SignatureError):
        store.deploy(forged, seg)
    stranger = TestCA(tmp_path / "stranger").sign(manifest_for(0, seg, CHAIN))
    with pytest.raises(SignatureError):
        store.deploy(stranger, seg)
    with pytest.raises(BudgetError, match="predicted"):
        store.deploy(ca.sign(manifest_for(0, seg, CHAIN, predicted_memory=65 << 20)), seg)
    junk = b"\x08\x07this is not an onnx model" * 10
    junk_manifest = manifest_for(0, junk, CHAIN)
    with pytest.raises(SegmentLoadError):
        store.deploy(ca.sign(junk_manifest), junk)
    with pytest.raises(WrongTargetError):
        segment_store(ca, name="a1").deploy(good, seg)
    deployed = store.deploy(good, seg)
    assert deployed.report.segment_sha256 == hashlib.sha256(seg).hexdigest()
    assert deployed.report.warmup_s > 0 and deployed.passthrough == ("x",)
    with pytest.raises(WrongTargetError, match="already loaded"):
        store.deploy(good, seg)
    assert store.unload(1) and store.get(1) is None


def test_cli_builds_one_config() -> None:
    import argparse

    from edge_agent.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    base = ["agent", "--name", "a0", "--memory", "64MiB", "--state-dir", "/tmp/x"]
    config = config_from_args(parser.parse_args([*base, "--port", "8470", "--threads", "2"]))
    assert (config.control_port, config.data_port) == (8470, 8471)
    assert config.memory_bytes == 64 << 20 and config.runtime.intra_op_threads == 2
    assert config.tls is None and config.interface == "127.0.0.1"
    with pytest.raises(ConfigError, match="go together"):
        config_from_args(parser.parse_args([*base, "--ca", "ca.pem"]))
    with pytest.raises(ConfigError, match="at least 1"):
        config_from_args(parser.parse_args([*base, "--threads", "0"]))
    # one agent per device: it uses the device's cores unless told
    assert config_from_args(parser.parse_args(base)).runtime.intra_op_threads == usable_cores()


def test_store_refuses_a_segment_whose_measured_memory_is_over_budget(tmp_path: Path) -> None:
    """The plan says 1 KiB; the 8 MiB of weights it really holds do not fit a 2 MiB budget."""
    from onnx import TensorProto, helper, numpy_helper

    # four 2 MiB weights: each passes the declared-size check, together they do not fit
    weight = np.ones((1024, 512), np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", f"w{i}"], [f"p{i}"]) for i in range(4)]
        + [helper.make_node("Concat", [f"p{i}" for i in range(4)], ["h"], axis=1)],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1024])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 2048])],
        [numpy_helper.from_array(weight + i, f"w{i}") for i in range(4)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    seg = model.SerializeToString()
    ca = TestCA(tmp_path)
    store = segment_store(ca, budget=2 << 20)
    io = [(["x"], ["h"], ["h"])]
    manifest = manifest_for(0, seg, CHAIN[:1], io=io, predicted_memory=1024)
    with pytest.raises(BudgetError, match="resident bytes after load"):
        store.deploy(ca.sign(manifest), seg)
    assert store.get(1) is None and store.committed_bytes() == 0
    assert not list((tmp_path / "segments-a0").glob("*.onnx"))  # the refused file is gone
