"""Helpers for the edge-agent tests: a test CA, tiny ONNX chains, agent processes, clients.

The CA stands in for the coordinator's pairing CA: it issues certificates with ``CN`` = device
name and ``OU`` = role, and signs deploy manifests with its key (protocols.deploy).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import itertools
import json
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID
from onnx import TensorProto, helper, numpy_helper

from coordinator.trust.ca import CertificateAuthority
from edge_agent.config import AgentConfig, TlsFiles
from edge_agent.net.channel import ChannelHandler, FrameChannel, FrameServer
from edge_agent.net.links import PeerLink
from edge_agent.net.tls import client_context, server_context
from edge_agent.trust.identity import Identity, load_identity
from protocols.deploy import (
    ROLE_AGENT,
    ROLE_COORDINATOR,
    DeployManifest,
    DeployRequest,
    Hop,
    encode_deploy_body,
    signing_bytes,
)
from protocols.manifest import Manifest, SegmentEntry

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@dataclass
class TestCA:
    """A CA on disk; issues certificates and signs deploy manifests."""

    __test__ = False
    directory: Path
    algorithm: str = "ecdsa-p256-sha256"
    key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey = field(init=False)
    cert: x509.Certificate = field(init=False)

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.key = (
            ed25519.Ed25519PrivateKey.generate()
            if self.algorithm == "ed25519"
            else ec.generate_private_key(ec.SECP256R1())
        )
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"test CA {id(self)}")])
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(self.key, self._hash())
        )
        self.ca_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def _hash(self) -> hashes.SHA256 | None:
        return None if self.algorithm == "ed25519" else hashes.SHA256()

    @property
    def ca_path(self) -> Path:
        return self.directory / "ca.pem"

    def issue(self, name: str, role: str = ROLE_AGENT) -> tuple[Path, Path]:
        """Certificate and key files for ``name`` with ``role``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.COMMON_NAME, name),
                        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                    ]
                )
            )
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName(name.lower())]), critical=False
            )
            .sign(self.key, self._hash())
        )
        cert_path = self.directory / f"{name}.pem"
        key_path = self.directory / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_path, key_path

    def certify(self, csr_pem: str, name: str, role: str = ROLE_AGENT) -> str:
        """PEM certificate for the key of a certificate request, issued by the coordinator's
        own code (:class:`CertificateAuthority`, EC P-256 only) with this CA's key."""
        assert isinstance(self.key, ec.EllipticCurvePrivateKey), "the coordinator's CA is EC"
        issued = CertificateAuthority(self.key, self.cert).issue(csr_pem.encode(), name, role)
        return issued.pem.decode()

    def sign(self, manifest: DeployManifest) -> DeployRequest:
        """A deploy request with this CA's signature over the manifest."""
        data = signing_bytes(manifest)
        if isinstance(self.key, ed25519.Ed25519PrivateKey):
            signature = self.key.sign(data)
        else:
            signature = self.key.sign(data, ec.ECDSA(hashes.SHA256()))
        return DeployRequest(
            manifest=manifest,
            signature_algorithm=self.algorithm,  # type: ignore[arg-type]
            signature_hex=signature.hex(),
        )

    def client_context(self, name: str, role: str = ROLE_COORDINATOR) -> ssl.SSLContext:
        """A TLS 1.3 client context presenting a certificate issued to ``name``."""
        cert, key = self.issue(name, role)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(cafile=str(self.ca_path))
        return ctx


# ---------------------------------------------------------------------------- tiny ONNX chain

WIDTH = 16


def chain_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "w0": rng.standard_normal((WIDTH, WIDTH)).astype(np.float32),
        "w2": rng.standard_normal((WIDTH, 4)).astype(np.float32),
    }


def _model(nodes: list, inputs: list, outputs: list, inits: dict[str, np.ndarray]) -> bytes:
    graph = helper.make_graph(
        nodes,
        "seg",
        inputs,
        outputs,
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _x(name: str, width: int = WIDTH) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", width])


def tiny_chain() -> list[bytes]:
    """Three segments: ``h = x @ w0`` | ``g = relu(h) + x`` (x passes through) | ``y = g @ w2``."""
    w = chain_weights()
    seg0 = _model(
        [helper.make_node("MatMul", ["x", "w0"], ["h"])], [_x("x")], [_x("h")], {"w0": w["w0"]}
    )
    seg1 = _model(
        [helper.make_node("Relu", ["h"], ["r"]), helper.make_node("Add", ["r", "x"], ["g"])],
        [_x("h"), _x("x")],
        [_x("g")],
        {},
    )
    seg2 = _model(
        [helper.make_node("MatMul", ["g", "w2"], ["y"])], [_x("g")], [_x("y", 4)], {"w2": w["w2"]}
    )
    return [seg0, seg1, seg2]


def tiny_reference(x: np.ndarray) -> np.ndarray:
    w = chain_weights()
    h = x @ w["w0"]
    return (np.maximum(h, 0) + x) @ w["w2"]


TINY_IO = [(["x"], ["h"], ["h", "x"]), (["h", "x"], ["g"], ["g"]), (["g"], ["y"], ["y"])]
"""Per segment: inputs, outputs, forward."""


def manifest_for(
    index: int,
    segment: bytes,
    chain: list[Hop],
    *,
    io: list[tuple[list[str], list[str], list[str]]] = TINY_IO,
    plan_version: int = 1,
    predicted_memory: int = 1 << 20,
    warmup_shapes: dict[str, list[int]] | None = None,
) -> DeployManifest:
    inputs, outputs, forward = io[index]
    return DeployManifest(
        deployment="tiny",
        plan_version=plan_version,
        segment=SegmentEntry(
            index=index,
            device=chain[index].device,
            file=f"segment_{index}.onnx",
            sha256=hashlib.sha256(segment).hexdigest(),
            inputs=inputs,
            outputs=outputs,
            param_bytes=len(segment),
            predicted_memory_bytes=predicted_memory,
            predicted_compute_s=0.001,
        ),
        chain=chain,
        forward=forward,
        warmup_shapes=warmup_shapes or {},
    )


# ---------------------------------------------------------------------------- agent processes


@dataclass
class AgentProc:
    """A running ``python -m edge_agent agent`` process."""

    name: str
    state_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    control_port: int = 0
    data_port: int = 0
    device_id: str = ""

    @property
    def hop(self) -> Hop:
        return Hop(device=self.name, host="127.0.0.1", data_port=self.data_port)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def url(self, path: str) -> str:
        return f"https://127.0.0.1:{self.control_port}{path}"


def start_agent(
    tmp: Path,
    name: str,
    ca: TestCA | None,
    *,
    memory: str = "256MiB",
    extra: list[str] | None = None,
) -> AgentProc:
    """Start an agent process (profile pre-cached when a sibling has one) and wait until ready."""
    state = tmp / f"state-{name}"
    state.mkdir(parents=True, exist_ok=True)
    args = [PYTHON, "-m", "edge_agent", "agent", "--name", name, "--memory", memory]
    args += ["--state-dir", str(state), "--interface", "127.0.0.1", "--threads", "1"]
    if ca is not None:
        cert, key = ca.issue(name)
        args += ["--ca", str(ca.ca_path), "--cert", str(cert), "--key", str(key)]
    args += extra or []
    log_path = tmp / f"{name}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(args, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
    agent = AgentProc(name=name, state_dir=state, proc=proc, log_path=log_path)
    ready = state / "agent.json"
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_agent(agent)
            raise RuntimeError(f"agent {name} did not start:\n{agent.log()}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    agent.control_port, agent.data_port = info["control_port"], info["data_port"]
    agent.device_id = info["device_id"]
    return agent


def stop_agent(agent: AgentProc, timeout: float = 15.0) -> int:
    """SIGTERM, wait, then SIGKILL if needed; returns the exit code."""
    if agent.proc.poll() is None:
        agent.proc.send_signal(signal.SIGTERM)
        try:
            agent.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            agent.proc.kill()
            agent.proc.wait(timeout)
    return agent.proc.returncode


@contextlib.contextmanager
def agents(
    tmp: Path, names: list[str], ca: TestCA | None, **kwargs: object
) -> Iterator[list[AgentProc]]:
    """Start several agents; always stop every one of them."""
    started: list[AgentProc] = []
    try:
        for name in names:
            if started:  # reuse the first agent's measured profile: saves a second per agent
                profile = started[0].state_dir / "profile.json"
                (tmp / f"state-{name}").mkdir(parents=True, exist_ok=True)
                shutil.copy(profile, tmp / f"state-{name}" / "profile.json")
            started.append(start_agent(tmp, name, ca, **kwargs))  # type: ignore[arg-type]
        yield started
    finally:
        for agent in started:
            stop_agent(agent)


def control_client(
    ca: TestCA, name: str = "coordinator", role: str = ROLE_COORDINATOR
) -> httpx.Client:
    return httpx.Client(verify=ca.client_context(name, role), timeout=60.0, trust_env=False)


def deploy(
    client: httpx.Client, agent: AgentProc, request: DeployRequest, segment: bytes
) -> httpx.Response:
    return client.post(agent.url("/v1/deploy"), content=encode_deploy_body(request, segment))


def deploy_chain(
    client: httpx.Client,
    ca: TestCA,
    procs: list[AgentProc],
    segments: list[bytes],
    **kwargs: object,
) -> list[dict[str, object]]:
    """Sign and deploy one segment per agent; returns the deploy reports."""
    chain = [p.hop for p in procs]
    reports = []
    for index, (proc, segment) in enumerate(zip(procs, segments, strict=True)):
        manifest = manifest_for(index, segment, chain, **kwargs)  # type: ignore[arg-type]
        response = deploy(client, proc, ca.sign(manifest), segment)
        assert response.status_code == 200, response.text
        reports.append(response.json())
    return reports


# ---------------------------------------------------------------------------- cutting real models


@dataclass
class CutChain:
    """A model cut into consecutive segments, in the form deploy manifests need."""

    segments: list[bytes]
    io: list[tuple[list[str], list[str], list[str]]]
    """Per segment: inputs, outputs, forward (what goes on to the next agent)."""
    first_inputs: list[str]
    """What a requester sends to the first agent."""


def cut_model(model: onnx.ModelProto, parts: int) -> CutChain:
    """Cut a model into ``parts`` segments at the narrowest frontiers near equal node counts.

    A stand-in for the partitioner's ``split`` (which plans by memory and compute): tensors
    that later segments need but an earlier segment does not produce are passed through.
    """
    from onnx.utils import Extractor

    model = onnx.shape_inference.infer_shapes(model)
    nodes = list(model.graph.node)
    end = len(nodes)
    static = {i.name for i in model.graph.initializer}
    static |= {o for n in nodes if n.op_type == "Constant" for o in n.output}
    graph_inputs = [i.name for i in model.graph.input if i.name not in static]
    outputs = [o.name for o in model.graph.output]
    produced_at: dict[str, int] = {name: -1 for name in graph_inputs}
    last_use: dict[str, int] = {}
    for idx, node in enumerate(nodes):
        for name in node.output:
            produced_at[name] = idx
        for name in node.input:
            if name and name not in static:
                last_use[name] = idx
    for name in outputs:
        last_use[name] = end

    def frontier(c: int) -> list[str]:
        return sorted(t for t, lu in last_use.items() if lu >= c and produced_at.get(t, end) < c)

    cuts = [0]
    for k in range(1, parts):
        target, window = end * k // parts, max(1, end // (4 * parts))
        candidates = range(max(cuts[-1] + 1, target - window), min(end, target + window))
        cuts.append(min(candidates, key=lambda c: (len(frontier(c)), abs(c - target))))
    cuts.append(end)
    extractor = Extractor(model)
    segments, io = [], []
    for a, b in itertools.pairwise(cuts):
        used = {name for node in nodes[a:b] for name in node.input if name}
        produced = {name for node in nodes[a:b] for name in node.output}
        inputs = [t for t in frontier(a) if t in used]
        forward = outputs if b == end else frontier(b)
        seg_outputs = [t for t in forward if t in produced]
        sub = extractor.extract_model(inputs, seg_outputs)
        segments.append(sub.SerializeToString())
        io.append((inputs, seg_outputs, forward))
    first_inputs = sorted(set(io[0][0]) | (set(io[0][2]) - set(io[0][1])))
    return CutChain(segments=segments, io=io, first_inputs=first_inputs)


def run_chain(chain: CutChain, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the segments one after another in this process (the expected chain result)."""
    import onnxruntime as ort

    values = dict(feeds)
    for segment, (inputs, outputs, forward) in zip(chain.segments, chain.io, strict=True):
        session = ort.InferenceSession(segment, providers=["CPUExecutionProvider"])
        result = session.run(outputs, {n: values[n] for n in inputs})
        values.update(zip(outputs, result, strict=True))
        values = {n: values[n] for n in forward}
    return values


def minilm_feeds(batch: int = 1, tokens: int = 128, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids, full attention mask, zero token types: MiniLM's three inputs."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 30000, size=(batch, tokens), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    return {
        "input_ids": ids,
        "attention_mask": np.ones((batch, tokens), np.int64),
        "token_type_ids": np.zeros((batch, tokens), np.int64),
    }


# ---------------------------------------------------------------------------- MiniLM via split

AGENT_NAMES = [f"a{i}-{secrets.token_hex(3)}" for i in range(3)]
"""Names of the agent processes tests start: unique per test run, because every process on this
machine shares loopback mDNS and another run's agents must not be mistaken for ours."""

MINILM_DEVICES = {
    "devices": [
        {"name": AGENT_NAMES[0], "memory_bytes": 70_000_000, "gflops": 80, "bandwidth_mbps": 1e4},
        {"name": AGENT_NAMES[1], "memory_bytes": 30_000_000, "gflops": 80, "bandwidth_mbps": 1e4},
        {"name": AGENT_NAMES[2], "memory_bytes": 30_000_000, "gflops": 80, "bandwidth_mbps": 1e4},
    ]
}
"""Budgets that force three segments: no two devices hold MiniLM's 90 MB."""


def minilm_model(cache: Path) -> Path:
    """all-MiniLM-L6-v2 exported by the partitioner's front door (cached in ``cache``)."""
    from partitioner.models import frontdoor

    key = hashlib.sha256(Path(frontdoor.__file__).read_bytes()).hexdigest()[:16]
    path = cache / f"minilm-{key}.onnx"
    if not path.exists():
        frontdoor.export_minilm(cache / "export.onnx")
        (cache / "export.onnx").replace(path)
    return path


def minilm_split(model: Path, out: Path) -> Manifest:
    """``fedshard split`` of MiniLM onto :data:`MINILM_DEVICES`, verified; the manifest."""
    from partitioner.cutting.inputs import SplitOptions
    from partitioner.cutting.split import split_model
    from protocols.devices import DeviceList

    devices = DeviceList.from_obj(MINILM_DEVICES)
    result = split_model(model, devices, out, SplitOptions(verify=True))
    return result.manifest


def forward_names(manifest: Manifest, index: int) -> list[str]:
    """What segment ``index`` must send on: names later segments (or the results) need that the
    model inputs and segments ``0..index`` make available."""
    segments = manifest.segments
    later = {n for s in segments[index + 1 :] for n in s.inputs}
    if index == len(segments) - 1:
        later = {o.name for o in manifest.model.outputs}
    available = {i.name for i in manifest.model.inputs}
    available |= {n for s in segments[: index + 1] for n in s.outputs}
    return sorted(later & available)


def segment_inputs(
    manifest: Manifest, seg_dir: Path, feeds: dict[str, np.ndarray]
) -> list[dict[str, np.ndarray]]:
    """Each segment's input tensors for ``feeds``, by running the chain here (warm-up frames)."""
    import onnxruntime as ort

    values = dict(feeds)
    per_segment = []
    for seg in manifest.segments:
        per_segment.append({n: values[n] for n in seg.inputs})
        session = ort.InferenceSession(str(seg_dir / seg.file), providers=["CPUExecutionProvider"])
        values.update(zip(seg.outputs, session.run(seg.outputs, per_segment[-1]), strict=True))
    return per_segment


def deploy_manifest(
    client: httpx.Client,
    ca: TestCA,
    procs: dict[str, AgentProc],
    manifest: Manifest,
    seg_dir: Path,
    warmups: list[dict[str, np.ndarray]],
    plan_version: int = 1,
) -> tuple[list[Hop], list[dict[str, object]]]:
    """Sign and push every segment of a split to the agent its manifest names."""
    from protocols.frames import FrameHeader, encode_frame

    chain = [procs[s.device].hop for s in manifest.segments]
    reports = []
    for seg, warm in zip(manifest.segments, warmups, strict=True):
        data = (seg_dir / seg.file).read_bytes()
        frame = encode_frame(FrameHeader(request_id="warmup"), warm)
        signed = DeployManifest(
            deployment=manifest.model.name,
            plan_version=plan_version,
            segment=seg,
            chain=chain,
            forward=forward_names(manifest, seg.index),
            warmup_sha256=hashlib.sha256(frame).hexdigest(),
        )
        body = encode_deploy_body(ca.sign(signed), data, frame)
        response = client.post(procs[seg.device].url("/v1/deploy"), content=body)
        assert response.status_code == 200, response.text
        reports.append(response.json())
    return chain, reports


# ---------------------------------------------------------------------------- TLS peers in-process

TLS_FRAME_LIMIT = 1 << 20
"""The frame size limit of the in-process servers and links below."""


def tls_identity(ca: TestCA, name: str, tmp: Path) -> Identity:
    """An agent identity ``name`` with a certificate from ``ca`` (its state dir ``tmp/name``)."""
    cert, key = ca.issue(name)
    return load_identity(
        AgentConfig(name, 1 << 20, tmp / name, tls=TlsFiles(ca.ca_path, cert, key))
    )


def request_id_recorder(into: list[str]) -> ChannelHandler:
    """A :class:`FrameServer` handler that appends every frame's request id to ``into``."""

    async def record(channel: FrameChannel) -> None:
        while (item := await channel.read()) is not None:
            into.append(item[0].header.request_id)

    return record


async def start_frame_server(
    handler: ChannelHandler, identity: Identity, port: int = 0
) -> tuple[FrameServer, int]:
    """A data-plane server on 127.0.0.1 (``port`` 0: a free one) presenting ``identity``'s
    certificate; the server and its port."""
    server = FrameServer(handler, server_context(identity), TLS_FRAME_LIMIT)
    return server, await server.start("127.0.0.1", port)


def peer_link(sender: Identity, device: str, port: int, **options: Any) -> PeerLink:
    """``sender``'s outgoing link to ``device`` at 127.0.0.1:``port``; ``options`` go to
    :class:`PeerLink` (``attempts``, ``backoff_s``)."""
    hop = Hop(device=device, host="127.0.0.1", data_port=port)
    return PeerLink(hop, client_context(sender), TLS_FRAME_LIMIT, **options)


@contextlib.asynccontextmanager
async def link_to_server(
    handler: ChannelHandler, server: Identity, sender: Identity, device: str, **options: Any
) -> AsyncIterator[tuple[PeerLink, int]]:
    """A server presenting ``server``'s certificate and ``sender``'s link to it, expecting
    ``device`` (see :func:`peer_link`); the link and the server's port. Both are closed at the
    end."""
    frame_server, port = await start_frame_server(handler, server)
    link = peer_link(sender, device, port, **options)
    try:
        yield link, port
    finally:
        await link.close()
        await frame_server.close()
