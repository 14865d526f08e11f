"""Integration: the coordinator and agents as real processes on 127.0.0.1.

One module-scoped lab: a coordinator, three agents paired through ``fedshard pair`` after the
coordinator found them by mDNS, and a fourth agent nobody pairs. MiniLM is deployed with
``fedshard deploy`` under planning caps that force three segments (no two devices may hold the
model). The tests then check embeddings against the unsharded model, the plan next to what the
agents measured, refusals (unpaired, no token, revoked), and a redeploy and rollback under a
stream of requests. Revocation runs last: it breaks the chain on purpose.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from agent_helpers import AgentProc, minilm_model
from coordinator_helpers import (
    CoordinatorProc,
    pairing_code,
    start_coordinator,
    stop_process,
    unpaired_agents,
    wait_for,
)

from protocols.frames import PREFIX_BYTES, FrameHeader, encode_frame, frame_length

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
log = logging.getLogger(__name__)

MODEL_ID = "all-minilm-l6-v2"
SENTENCES = [
    "A quick brown fox jumps over the lazy dog.",
    "The coordinator splits one network across the devices of a local network.",
    "Sharding here means runtime placement of tensors.",
    "Paris is the capital of France.",
    "How do I bake bread at home?",
]
CAPS = {"a0": "70MB", "a1": "30MB", "a2": "30MB"}
"""Planning caps that force three segments: MiniLM's 90 MB of weights fit on no two devices."""
AGENT_MEMORY = "512MiB"
"""The agents' own budgets: generous, so ONNX Runtime's real resident memory fits (the agent
refuses a segment whose measured memory exceeds the free budget) and a second version fits
beside the first during a redeploy."""


@dataclass
class Lab:
    coordinator: CoordinatorProc
    tmp: Path
    agents: dict[str, AgentProc]
    """By role (a0, a1, a2, spare); device names carry a per-run suffix."""
    wrong_code: Any = None
    deploy_out: str = ""
    stream_failures: list[str] = field(default_factory=list)

    def name(self, role: str) -> str:
        return self.agents[role].name


@pytest.fixture(scope="module")
def lab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    pytest.importorskip("transformers")
    model = minilm_model(Path(request.config.cache.mkdir("fedshard-minilm")))
    tmp = tmp_path_factory.mktemp("coordinator-e2e")
    suffix = secrets.token_hex(3)  # other tests on this host advertise agents named a0 too
    roles = ["a0", "a1", "a2", "spare"]
    coordinator = start_coordinator(tmp)
    try:
        names = [f"{role}-{suffix}" for role in roles]
        with unpaired_agents(tmp, names, AGENT_MEMORY) as procs:
            lab = Lab(coordinator, tmp, dict(zip(roles, procs, strict=True)))
            _pair_three(lab)
            caps = [f"{lab.name(role)}={size}" for role, size in CAPS.items()]
            args = ["deploy", str(model), "--name", MODEL_ID]
            for cap in caps:
                args += ["--memory-cap", cap]
            result = coordinator.cli(*args)
            assert result.returncode == 0, result.stdout + result.stderr + coordinator.log()
            lab.deploy_out = result.stdout
            lab.model = model  # type: ignore[attr-defined]
            lab.caps = caps  # type: ignore[attr-defined]
            yield lab
    finally:
        stop_process(coordinator.proc)
        if "lab" in locals():
            stop_process(lab.coordinator.proc)  # the restart test replaced the first one


def _pair_three(lab: Lab) -> None:
    api = lab.coordinator.api()
    expected = {lab.name(r) for r in lab.agents}
    found = wait_for(lambda: expected <= {d.name for d in api.devices()}, 10)
    assert found, api.devices()
    wrong = "AAAA-AAAA" if pairing_code(lab.agents["a0"]) != "AAAA-AAAA" else "BBBB-BBBB"
    lab.wrong_code = lab.coordinator.cli("pair", lab.name("a0"), wrong)
    for role in ("a0", "a1", "a2"):
        agent = lab.agents[role]
        result = lab.coordinator.cli("pair", agent.name, pairing_code(agent))
        assert result.returncode == 0, result.stdout + result.stderr
    assert wait_for(lambda: _statuses(lab)[:3] == ["paired"] * 3, 10), _statuses(lab)


def _statuses(lab: Lab) -> list[str]:
    """Each agent's pairing status as the API lists it (``missing`` while it is offline)."""
    online = {d.name: d.status for d in lab.coordinator.api().devices() if d.online}
    return [online.get(lab.name(r), "missing") for r in lab.agents]


def _embed(api: httpx.Client, texts: list[str]) -> httpx.Response:
    return api.post("/v1/embeddings", json={"model": MODEL_ID, "input": texts})


def _reference(texts: list[str]) -> np.ndarray:
    """The unsharded model in transformers, from the same package's weights."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from partitioner.models.packaged import minilm_dir

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    model = AutoModel.from_pretrained(minilm_dir()).eval()
    encoded = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()


def test_pairing_by_cli_after_mdns_discovery(lab: Lab) -> None:
    assert lab.wrong_code.returncode == 1
    assert "does not match" in lab.wrong_code.stdout
    with lab.coordinator.client() as api:
        assert _statuses(lab) == ["paired", "paired", "paired", "unpaired"]
        pending = api.get("/v1/pairing").json()["pending"]
        spare = lab.name("spare")
        offers = [p for p in pending if p["name"] == spare]  # the code is shown on the device only
        assert [(p["code"], len(p["key_id"])) for p in offers] == [(None, 16)]
        assert pairing_code(lab.agents["spare"]) not in json.dumps(pending)
    listing = lab.coordinator.cli("devices")
    assert listing.returncode == 0 and lab.name("spare") in listing.stdout
    key = lab.coordinator.state_dir / "ca_key.pem"
    assert key.stat().st_mode & 0o777 == 0o600


def test_embeddings_match_the_unsharded_model(lab: Lab) -> None:
    with lab.coordinator.client() as api:
        response = _embed(api, SENTENCES)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == MODEL_ID
    got = np.array([item["embedding"] for item in body["data"]], dtype=np.float64)
    want = _reference(SENTENCES).astype(np.float64)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert got.shape == (len(SENTENCES), 384)
    assert cosine.min() > 0.9999, cosine


def test_models_and_plan_next_to_reality(lab: Lab) -> None:
    with lab.coordinator.client() as api:
        models = api.get("/v1/models").json()
        [record] = [m for m in api.get("/v1/deployments").json() if m["model_id"] == MODEL_ID]
    assert models["object"] == "list" and MODEL_ID in [m["id"] for m in models["data"]]
    [live] = [v for v in record["versions"] if v["state"] == "active"]
    devices = [p["device"] for p in live["segments"]]
    assert len(devices) == 3 and set(devices) == {lab.name(r) for r in ("a0", "a1", "a2")}
    for placement in live["segments"]:
        assert placement["predicted_memory_bytes"] > 0 and placement["predicted_compute_s"] > 0
        assert placement["measured_memory_bytes"] > 0 and placement["warmup_s"] > 0
    assert live["health_max_abs_diff"] <= 1e-4
    assert all(column in lab.deploy_out for column in ("pred. MB", "KV MB", "meas. MB"))
    by_name = {agent.name: agent for agent in lab.agents.values()}
    for placement in live["segments"]:  # each device received its own segment and no other
        stored = {p.stem for p in (by_name[placement["device"]].state_dir / "segments").iterdir()}
        assert stored == {placement["sha256"]}
    with lab.coordinator.client() as api:
        links = api.get("/v1/links").json()
        requester = api.get("/v1/links/requester").json()
    paired = {lab.name(r) for r in ("a0", "a1", "a2")}
    assert len(links) == 3 and all({link["a"], link["b"]} <= paired for link in links)
    assert all(link["bandwidth_mbps"] > 1 and link["latency_ms"] > 0 for link in links)
    # the coordinator measured its own link to each device: the plan counts input and result
    assert {link["device"] for link in requester} == paired
    assert all(link["bandwidth_mbps"] > 1 and link["latency_ms"] > 0 for link in requester)


def test_unpaired_fourth_agent_is_never_used(lab: Lab) -> None:
    spare = lab.name("spare")
    with lab.coordinator.client() as api:
        records = api.get("/v1/deployments").json()
    [device] = [d for d in lab.coordinator.api().devices() if d.name == spare]
    used = {p["device"] for m in records for v in m["versions"] for p in v["segments"]}
    assert spare not in used
    assert device.status == "unpaired" and device.announcement.state.plan_version == 0


def test_joins_and_leaves_are_seen_within_3_s(lab: Lab) -> None:
    """A new agent appears in the registry, and one that stops disappears, within 3 s each."""
    name = f"visitor-{secrets.token_hex(3)}"

    def online() -> bool:
        return any(d.name == name and d.online for d in lab.coordinator.api().devices())

    with unpaired_agents(lab.tmp, [name], AGENT_MEMORY) as [visitor]:
        assert wait_for(online, 3.0), f"{name} not seen within 3 s of its start"
        stop_process(visitor.proc)
        assert wait_for(lambda: not online(), 3.0), f"{name} still listed 3 s after it stopped"


def test_no_token_gets_401(lab: Lab) -> None:
    with httpx.Client(base_url=lab.coordinator.url, trust_env=False) as anonymous:
        assert anonymous.get("/v1/models").status_code == 401
        assert (
            anonymous.post("/v1/embeddings", json={"model": MODEL_ID, "input": "x"}).status_code
            == 401
        )
        wrong = {"Authorization": "Bearer not-the-token"}
        assert anonymous.get("/v1/devices", headers=wrong).status_code == 401


def test_api_errors_are_4xx_with_a_message(lab: Lab) -> None:
    with lab.coordinator.client() as api:
        unknown = api.post("/v1/embeddings", json={"model": "nope", "input": "x"})
        assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]
        bad = api.post(
            "/v1/infer", content=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert bad.status_code == 400 and "malformed" in bad.json()["detail"]
        ids = np.array([[101, 2023, 102]], dtype=np.int64)
        shape = api.post(
            "/v1/infer",
            json={
                "model": MODEL_ID,
                "inputs": {
                    "input_ids": ids.tolist(),
                    "attention_mask": [1, 1, 1],
                    "token_type_ids": [[0, 0, 0]],
                },
            },
        )
        assert shape.status_code == 400 and "rank" in shape.json()["detail"]
        import io

        buffer = io.BytesIO()
        np.savez(
            buffer,
            input_ids=ids,
            attention_mask=np.ones_like(ids),
            token_type_ids=np.zeros_like(ids),
        )
        npz = api.post(
            f"/v1/infer?model={MODEL_ID}",
            content=buffer.getvalue(),
            headers={"Content-Type": "application/x-npz"},
        )
        assert npz.status_code == 200, npz.text
        assert npz.json()["outputs"]["last_hidden_state"]["shape"] == [1, 3, 384]


def test_redeploy_under_200_streaming_requests_then_rollback(lab: Lab) -> None:
    done = threading.Event()
    served: list[int] = []
    failures: list[str] = []
    switched = [0]

    def stream() -> None:
        with lab.coordinator.client() as api:
            # until the deploy is over, 200 requests are in, and 30 ran after the switch
            while not (done.is_set() and len(served) >= 200 and len(served) >= switched[0] + 30):
                response = _embed(api, SENTENCES[:2])
                if response.status_code == 200:
                    served.append(int(response.headers["X-Fedshard-Version"]))
                else:
                    failures.append(f"{response.status_code}: {response.text}")

    with lab.coordinator.client() as api:
        before = api.get("/v1/deployments").json()[0]["active"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        streams = [pool.submit(stream) for _ in range(3)]
        assert wait_for(lambda: len(served) >= 20 or bool(failures), 60)
        args = ["deploy", str(lab.model), "--name", MODEL_ID]  # type: ignore[attr-defined]
        for cap in lab.caps:  # type: ignore[attr-defined]
            args += ["--memory-cap", cap]
        started = time.monotonic()
        result = lab.coordinator.cli(*args)
        deploy_s = time.monotonic() - started
        switched[0] = len(served)
        done.set()
        for future in streams:
            future.result(timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    log.info(
        "redeploy took %.1f s under the stream; %d requests, %d failed, per version %s",
        deploy_s,
        len(served) + len(failures),
        len(failures),
        {v: served.count(v) for v in sorted(set(served))},
    )
    assert failures == []
    assert len(served) >= 200
    after = max(served)
    assert after != before and served[0] == before and served[-1] == after
    rollback = lab.coordinator.cli("rollback", MODEL_ID)
    assert rollback.returncode == 0, rollback.stdout + rollback.stderr
    with lab.coordinator.client() as api:
        response = _embed(api, SENTENCES[:1])
        assert response.status_code == 200
        assert int(response.headers["X-Fedshard-Version"]) == before


def test_restart_keeps_ca_pairings_and_deployments(lab: Lab) -> None:
    state = lab.coordinator.state_dir
    ca_before, token = (state / "ca_cert.pem").read_bytes(), lab.coordinator.token
    with lab.coordinator.client() as api:
        active = api.get("/v1/deployments").json()[0]["active"]
    assert stop_process(lab.coordinator.proc) == 0
    lab.coordinator = start_coordinator(lab.tmp)
    assert lab.coordinator.state_dir == state and lab.coordinator.token == token
    assert (state / "ca_cert.pem").read_bytes() == ca_before
    with lab.coordinator.client() as api:
        assert wait_for(lambda: _statuses(lab)[:3] == ["paired"] * 3, 10)
        assert api.get("/v1/deployments").json()[0]["active"] == active
        response = _embed(api, SENTENCES[:2])
    assert response.status_code == 200, response.text
    assert int(response.headers["X-Fedshard-Version"]) == active


def _agent_tls(agent: AgentProc) -> ssl.SSLContext:
    """A TLS client context with an agent's own certificate (as that agent would connect)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(agent.state_dir / "cert.pem", agent.state_dir / "agent_key.pem")
    ctx.load_verify_locations(cafile=str(agent.state_dir / "ca.pem"))
    return ctx


def _control_ok(ctx: ssl.SSLContext, target: AgentProc) -> bool:
    """Whether the target's control plane admits the connection and answers (an agent's
    ``/v1/status`` is for the coordinator only: another agent gets 403, a revoked one nothing)."""
    try:
        with httpx.Client(verify=ctx, timeout=10, trust_env=False) as client:
            return client.get(target.url("/v1/status")).status_code == 403
    except httpx.TransportError:
        return False


def _data_ok(ctx: ssl.SSLContext, target: AgentProc) -> bool:
    """Whether a link-probe frame on the target's data plane gets its answer."""
    try:
        raw = socket.create_connection(("127.0.0.1", target.data_port), timeout=10)
        with ctx.wrap_socket(raw) as tls:
            tls.sendall(encode_frame(FrameHeader(request_id="probe/check"), {}))
            prefix = _recv_exactly(tls, PREFIX_BYTES)
            return len(_recv_exactly(tls, frame_length(prefix) - PREFIX_BYTES)) > 0
    except (OSError, ssl.SSLError, EOFError):
        return False


def _recv_exactly(sock: ssl.SSLSocket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("connection closed")
        data += chunk
    return data


def test_revoked_agent_is_refused_on_both_planes(lab: Lab) -> None:
    revoked, peer = lab.agents["a2"], lab.agents["a0"]
    ctx = _agent_tls(revoked)
    assert _control_ok(ctx, peer) and _data_ok(ctx, peer)  # before: a paired peer is served
    result = lab.coordinator.cli("revoke", revoked.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert wait_for(lambda: not _control_ok(ctx, peer), 10)
    assert not _data_ok(ctx, peer)
    with lab.coordinator.client() as api:
        statuses = {d.name: d.status for d in lab.coordinator.api().devices() if d.online}
        assert statuses[revoked.name] == "revoked"
        again = lab.coordinator.cli("pair", revoked.name, pairing_code(revoked))
        assert again.returncode == 1 and "revoked" in again.stdout
        refused = _embed(api, SENTENCES[:1])  # the live version runs on the revoked device
        assert refused.status_code == 503 and "revoked" in refused.json()["error"]["message"]
