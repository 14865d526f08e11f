"""``fedshard.training-copy/1``: the served version a training agent gets before a LoRA run.

The coordinator's side (:mod:`coordinator.training.copies`: the copy of a staged segments dir,
signed with a real CA) against the agent's (:mod:`edge_agent.training.copies`): signature,
storage cap, hash and size of every file, the body limit before a file is read, the atomic
switch of ``current``, and a second copy that sends only what changed and drops the rest.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from coordinator.training.copies import send_copy, signed_offer, training_copy
from coordinator.transport.agent_client import AgentAddress
from coordinator.trust.ca import CertificateAuthority
from edge_agent.errors import IntegrityError, SignatureError, StorageError
from edge_agent.net.control import Response
from edge_agent.training.copies import TrainingCopies, training_routes
from protocols.errors import SchemaError
from protocols.manifest import Manifest, ModelInfo, SegmentEntry
from protocols.training_copy import TrainingCopyOffer, TrainingCopyStatus

SEGMENTS = {"seg0.onnx": b"frozen prefix" * 100, "seg1.onnx": b"adapted tail" * 50}


def _version(root: Path, segments: dict[str, bytes]) -> Path:
    """A version dir: a real manifest listing ``segments``, their files and a tokenizer."""
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, (name, data) in enumerate(segments.items()):
        (root / name).write_bytes(data)
        entries.append(
            SegmentEntry(
                index=i,
                device=f"d{i}",
                file=name,
                sha256=hashlib.sha256(data).hexdigest(),
                inputs=[],
                outputs=[],
                param_bytes=len(data),
                predicted_memory_bytes=len(data),
                predicted_compute_s=0.0,
            )
        )
    model = ModelInfo(name="toy", sha256="0" * 64, param_bytes=0, inputs=[], outputs=[])
    manifest = Manifest(
        model=model, objective="throughput", bottleneck_s=0.0, latency_s=0.0, segments=entries
    )
    (root / "manifest.json").write_text(manifest.to_json())
    (root / "tokenizer.json").write_text('{"model": "toy"}')
    return root


def _agent(tmp: Path, ca: CertificateAuthority, storage: int = 1 << 20) -> TrainingCopies:
    key = x509.load_pem_x509_certificate(ca.cert_pem).public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    return TrainingCopies(tmp / "agent" / "training", storage, lambda: key)


class _Loopback:
    """The agent client's two training calls, straight into an agent's handlers."""

    def __init__(self, agent: TrainingCopies) -> None:
        self.agent = agent
        self.files = 0

    def training_copy(self, _: AgentAddress, offer: TrainingCopyOffer) -> TrainingCopyStatus:
        return self.agent.offer(offer.model_dump_json().encode())

    def training_file(self, _: AgentAddress, data: bytes) -> TrainingCopyStatus:
        assert len(data) <= self.agent.largest_missing()  # what the route checks first
        self.files += 1
        return self.agent.receive(data)


def _send(agent: TrainingCopies, offer: TrainingCopyOffer, version: Path) -> int:
    client = _Loopback(agent)
    status = send_copy(client, AgentAddress("a", "127.0.0.1", 1), offer, version)  # type: ignore[arg-type]
    assert status.ready and not status.missing
    return client.files


def test_a_signed_copy_is_installed_file_by_file_and_current_points_at_it(tmp_path: Path) -> None:
    ca = CertificateAuthority.open(tmp_path / "coordinator")
    version = _version(tmp_path / "v1", SEGMENTS)
    offer = signed_offer(training_copy("tiny-v1", version, ["tokenizer.json"]), ca.sign)
    agent = _agent(tmp_path, ca)
    assert agent.largest_missing() == 0  # no offer: a file body of any size is refused
    assert _send(agent, offer, version) == 4
    assert agent.current.is_symlink()
    for name in [*SEGMENTS, "manifest.json", "tokenizer.json"]:
        assert (agent.current / name).read_bytes() == (version / name).read_bytes()
    assert agent.largest_missing() == 0


def test_a_second_copy_sends_only_what_changed_and_drops_the_rest(tmp_path: Path) -> None:
    ca = CertificateAuthority.open(tmp_path / "coordinator")
    agent = _agent(tmp_path, ca)
    first = _version(tmp_path / "v1", SEGMENTS)
    _send(agent, signed_offer(training_copy("m-v1", first, ["tokenizer.json"]), ca.sign), first)
    changed = dict(SEGMENTS, **{"seg1.onnx": b"merged adapters" * 40})
    second = _version(tmp_path / "v2", changed)
    offer = signed_offer(training_copy("m-v2", second, ["tokenizer.json"]), ca.sign)
    assert _send(agent, offer, second) == 2  # the new segment and the new manifest
    assert (agent.current / "seg1.onnx").read_bytes() == changed["seg1.onnx"]
    blobs = {p.name for p in (agent.root / "copy-blobs").iterdir()}
    assert blobs == {f.sha256 for f in offer.version.files}, "the old copy's files are gone"
    assert [p.name for p in (agent.root / "copies").iterdir()] == ["m-v2"]
    # the same copy again: nothing to send, installed at once
    assert agent.offer(offer.model_dump_json().encode()).ready


def test_a_copy_signed_by_another_ca_is_refused_before_anything_changes(tmp_path: Path) -> None:
    ca = CertificateAuthority.open(tmp_path / "coordinator")
    rogue = CertificateAuthority.open(tmp_path / "rogue")
    agent = _agent(tmp_path, ca)
    version = _version(tmp_path / "v1", SEGMENTS)
    _send(agent, signed_offer(training_copy("m-v1", version, ["tokenizer.json"]), ca.sign), version)
    forged = signed_offer(training_copy("m-v9", version, []), rogue.sign)
    with pytest.raises(SignatureError):
        agent.offer(forged.model_dump_json().encode())
    assert agent.current.resolve().name == "m-v1", "the installed copy is untouched"
    tampered = forged.model_copy(update={"signature_hex": "zz"})
    with pytest.raises((SignatureError, SchemaError)):
        agent.offer(tampered.model_dump_json().encode())


def test_limits_storage_hashes_and_sizes(tmp_path: Path) -> None:
    ca = CertificateAuthority.open(tmp_path / "coordinator")
    version = _version(tmp_path / "v1", SEGMENTS)
    offer = signed_offer(training_copy("m-v1", version, ["tokenizer.json"]), ca.sign)
    small = _agent(tmp_path / "small", ca, storage=offer.version.total_bytes - 1)
    with pytest.raises(StorageError):
        small.offer(offer.model_dump_json().encode())
    agent = _agent(tmp_path, ca)
    with pytest.raises(IntegrityError):  # no offer pending
        agent.receive(SEGMENTS["seg0.onnx"])
    agent.offer(offer.model_dump_json().encode())
    assert agent.largest_missing() == len(SEGMENTS["seg0.onnx"])
    with pytest.raises(IntegrityError):  # not a file of the offer
        agent.receive(b"something else")
    assert not agent.current.exists()
    with pytest.raises(SchemaError):  # a path in a name never reaches the disk
        TrainingCopyOffer.from_json(
            offer.model_dump_json().replace('"seg0.onnx"', '"../seg0.onnx"')
        )


def test_the_file_route_is_limited_to_the_largest_missing_file(tmp_path: Path) -> None:
    ca = CertificateAuthority.open(tmp_path / "coordinator")
    agent = _agent(tmp_path, ca)
    routes = training_routes(agent)
    route = routes[("POST", "/v1/training/file")]
    assert route.body_limit is not None and route.body_limit() == 0
    version = _version(tmp_path / "v1", SEGMENTS)
    offer = signed_offer(training_copy("m-v1", version, ["tokenizer.json"]), ca.sign)

    async def post_offer() -> Response:
        return await routes[("POST", "/v1/training/copy")].handler(offer.model_dump_json().encode())

    reply = asyncio.run(post_offer())
    assert reply.status == 200 and len(TrainingCopyStatus.from_json(reply.body).missing) == 4
    assert route.body_limit() == len(SEGMENTS["seg0.onnx"])


def test_the_control_plane_refuses_oversized_files_and_other_roles_before_the_body(
    tmp_path: Path,
) -> None:
    """Through the real :class:`ControlServer`: a declared body over the largest missing file
    is answered 413 without a byte of it sent; an agent-role peer gets 403."""
    from edge_agent.net.control import ControlServer
    from edge_agent.net.tls import Peer
    from protocols.deploy import ROLE_AGENT, ROLE_COORDINATOR

    ca = CertificateAuthority.open(tmp_path / "coordinator")
    agent = _agent(tmp_path, ca)
    version = _version(tmp_path / "v1", SEGMENTS)
    agent.offer(
        signed_offer(training_copy("m-v1", version, []), ca.sign).model_dump_json().encode()
    )
    server = ControlServer(training_routes(agent), 1 << 30)

    async def ask(role: str, length: int) -> bytes:
        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.handle(reader, writer, Peer("c", role))
            writer.close()

        listener = await asyncio.start_server(on_connection, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = f"POST /v1/training/file HTTP/1.1\r\nContent-Length: {length}\r\n\r\n"
            writer.write(head.encode())  # and no body
            return await asyncio.wait_for(reader.read(), 10)
        finally:
            listener.close()

    assert asyncio.run(ask(ROLE_COORDINATOR, 10 << 20)).startswith(b"HTTP/1.1 413")
    assert asyncio.run(ask(ROLE_AGENT, 10)).startswith(b"HTTP/1.1 403")


def test_a_rounds_segments_are_read_one_at_a_time_and_checked_again(tmp_path: Path) -> None:
    """What the ClientApp trains from (``lora/train.py: SegmentFiles``): hashes checked once,
    each file read only when indexed, and a file swapped after the check refused."""
    from edge_agent.training.errors import PlanMismatchError
    from edge_agent.training.lora.train import SegmentFiles

    version = _version(tmp_path / "v1", SEGMENTS)
    paths = [version / name for name in SEGMENTS]
    files = SegmentFiles(paths, [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths])
    assert len(files) == 2 and len(files[:1]) == 1
    assert list(files) == list(SEGMENTS.values())
    paths[1].write_bytes(b"swapped after the check")
    assert files[0] == SEGMENTS["seg0.onnx"]
    with pytest.raises(PlanMismatchError):
        files[1]


def test_the_copy_goes_to_keyed_agents_and_too_few_holders_fail_the_run(tmp_path: Path) -> None:
    """Coordinator side: only agents with a node key are offered the copy, an agent that does
    not train (404) is skipped, and fewer holders than the run needs fail it with reasons."""
    from coordinator.config import AgentTrainingConfig
    from coordinator.errors import AgentRefusedError
    from coordinator.training.errors import TrainingRunError
    from coordinator.training.target import PairedAgents
    from protocols.errors import ControlErrorCode

    ca = CertificateAuthority.open(tmp_path / "coordinator")
    version = _version(tmp_path / "v1", SEGMENTS)
    offer = signed_offer(training_copy("m-v1", version, ["tokenizer.json"]), ca.sign)
    trainers = {name: _agent(tmp_path / name, ca) for name in ("a", "b")}
    asked: list[str] = []

    class Client:
        """The agents' handlers by device name (called from several threads at once)."""

        def training_copy(
            self, agent: AgentAddress, offer: TrainingCopyOffer
        ) -> TrainingCopyStatus:
            asked.append(agent.device)
            if agent.device not in trainers:
                raise AgentRefusedError(agent.device, 404, ControlErrorCode.NOT_FOUND, "no route")
            return trainers[agent.device].offer(offer.model_dump_json().encode())

        def training_file(self, agent: AgentAddress, data: bytes) -> TrainingCopyStatus:
            assert len(data) <= trainers[agent.device].largest_missing()
            return trainers[agent.device].receive(data)

    devices = [AgentAddress(n, "127.0.0.1", 1) for n in ("a", "b", "plain", "unkeyed")]
    keys = {"a": "ka", "b": "kb", "plain": "kp"}
    paired = PairedAgents(
        AgentTrainingConfig(9093, 2), "127.0.0.1", lambda: keys,
        Client(), lambda: devices,  # type: ignore[arg-type]
    )  # fmt: skip
    assert sorted(paired.send_copy(offer, version, 2)) == ["a", "b"]
    assert sorted(asked) == ["a", "b", "plain"], "no offer to an agent without a node key"
    for agent in trainers.values():
        assert (agent.current / "manifest.json").is_file()
    with pytest.raises(TrainingRunError, match=r"2 paired agents hold .* needs 3.*plain: does not"):
        paired.send_copy(offer, version, 3)
