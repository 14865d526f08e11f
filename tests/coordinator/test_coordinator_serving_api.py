"""The serving API's error paths: every bad request is a 4xx with a message, an unservable
model a 503 with the reason, and no stack trace ever leaves the process (fakes only: the one
deployment points at a port where nothing listens)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from coordinator.deploy.deployer import Deployer
from coordinator.deploy.store import DeploymentStore, Placement, VersionRecord
from coordinator.errors import RequestError
from coordinator.fleet.links import LinkMeter
from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.app import Services, create_app
from coordinator.http.serving import Serving, model_id_of
from coordinator.serving.embeddings import Embedder, mean_pool
from coordinator.serving.router import Router, check_inputs
from coordinator.transport.agent_client import AgentClient
from coordinator.transport.dataplane import DataPlane
from coordinator.transport.tls import client_context
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.identity import open_identity
from coordinator.trust.pairing import Pairing
from protocols.manifest import TensorInfo

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INPUTS = [
    TensorInfo(name="input_ids", dtype="int64", shape=["batch", "sequence"]),
    TensorInfo(name="mask", dtype="float32", shape=["batch", 4]),
]


def _version(plan_version: int) -> VersionRecord:
    placement = Placement(
        index=0,
        device="ghost",
        host="127.0.0.1",
        control_port=1,
        data_port=1,  # nothing listens there
        sha256="0" * 64,
        param_bytes=1,
        predicted_memory_bytes=1,
        predicted_compute_s=0.0,
        measured_memory_bytes=1,
        warmup_s=0.0,
        load_s=0.0,
    )
    return VersionRecord(
        model_id="enc",
        version=plan_version,
        plan_version=plan_version,
        kind="encoder",
        state="active",
        created_at=0.0,
        source="enc.onnx",
        objective="throughput",
        inputs=INPUTS,
        outputs=[TensorInfo(name="y", dtype="float32", shape=["batch", 4])],
        segments=[placement],
        health_max_abs_diff=0.0,
    )


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    ca = CertificateAuthority.open(tmp_path)
    ctx = client_context(open_identity(tmp_path, ca))
    store = DeploymentStore(tmp_path)
    store.activate(_version(1), None)
    plane = DataPlane()
    router = Router(store, plane, ctx)
    agents = AgentClient(ctx)
    deployer = Deployer(tmp_path, store, agents, list, list, ca.sign, router.health)
    serving = Serving(store, deployer, router, Embedder(store, router), LinkMeter(agents, list))
    registry, pairing = DeviceRegistry(), Pairing(tmp_path, ca)
    app = create_app(Services(TOKEN, registry, pairing, None, serving))
    try:
        with TestClient(app, raise_server_exceptions=False) as test_client:
            yield test_client
    finally:
        router.close()
        plane.close()


def _infer(client: TestClient, inputs: object, model: str = "enc") -> tuple[int, str]:
    response = client.post("/v1/infer", json={"model": model, "inputs": inputs}, headers=AUTH)
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "Traceback" not in detail
    return response.status_code, detail


GOOD = {"input_ids": [[1, 2, 3]], "mask": [[1.0, 0.0, 1.0, 1.0]]}


def test_bad_inference_requests_are_4xx_with_a_message(client: TestClient) -> None:
    assert _infer(client, GOOD, model="nope") == (404, "no model 'nope' is deployed")
    code, detail = _infer(client, {"input_ids": [[1]]})
    assert code == 400 and "missing ['mask']" in detail
    code, detail = _infer(client, {**GOOD, "mask": [1.0, 0.0, 1.0, 1.0]})
    assert code == 400 and "rank 1" in detail
    code, detail = _infer(client, {**GOOD, "mask": [[1.0, 0.0]]})
    assert code == 400 and "axis 1" in detail
    code, detail = _infer(client, {**GOOD, "input_ids": [[1.5, 2, 3]]})
    assert code == 400 and "integers" in detail
    code, detail = _infer(client, {**GOOD, "input_ids": [["a", "b"]]})
    assert code == 400 and "numbers" in detail
    code, detail = _infer(client, {**GOOD, "input_ids": [[1, 2], [3]]})
    assert code == 400 and "rectangular" in detail
    malformed = client.post(
        "/v1/infer", content=b"{", headers={**AUTH, "Content-Type": "application/json"}
    )
    assert malformed.status_code == 400 and "malformed" in malformed.json()["detail"]


def test_npz_bodies_refuse_pickles_and_garbage(client: TestClient) -> None:
    headers = {**AUTH, "Content-Type": "application/x-npz"}
    buffer = io.BytesIO()
    np.savez(buffer, input_ids=np.array([{"evil": 1}], dtype=object))
    pickled = client.post("/v1/infer?model=enc", content=buffer.getvalue(), headers=headers)
    assert pickled.status_code == 400 and "pickle" in pickled.json()["detail"].lower()
    garbage = client.post("/v1/infer?model=enc", content=b"not a zip", headers=headers)
    assert garbage.status_code == 400
    nameless = client.post("/v1/infer", content=b"x", headers=headers)
    assert nameless.status_code == 400 and "?model=" in nameless.json()["detail"]


def test_unservable_model_is_503_with_the_reason(client: TestClient) -> None:
    code, detail = _infer(client, GOOD)
    assert code == 503 and "cannot be served" in detail and "ghost" in detail


def test_embeddings_and_deployment_errors(client: TestClient) -> None:
    def embed(body: object) -> tuple[int, str]:
        response = client.post("/v1/embeddings", json=body, headers=AUTH)
        return response.status_code, str(response.json()["error"]["message"])

    assert embed({"model": "nope", "input": "x"})[0] == 404
    code, detail = embed({"model": "enc", "input": "hello"})
    assert code == 400 and "not a text encoder" in detail
    assert embed({"model": "enc", "input": []})[0] == 400
    assert embed({"model": "enc", "input": "x", "encoding_format": "hex"})[0] == 400
    assert embed({"model": "enc", "input": [1, 2]})[1] == detail  # token ids, same model check
    assert embed({"model": "enc", "input": [[1], []]})[0] == 400
    assert embed({"model": "enc", "input": ["a", 1]})[0] == 400
    assert embed({"model": "enc", "input": "x", "dimensions": 0})[0] == 400
    assert embed({"model": "enc", "input": "x", "frobnicate": 1})[0] == 400
    not_utf8 = client.post(
        "/v1/embeddings", content=b'{"\xe8', headers={**AUTH, "content-type": "application/json"}
    )
    assert (
        not_utf8.status_code == 400 and not_utf8.json()["error"]["type"] == "invalid_request_error"
    )
    rollback = client.post("/v1/deployments/enc/rollback", headers=AUTH)
    assert rollback.status_code == 409 and "no previous version" in rollback.json()["detail"]
    missing = client.post("/v1/deployments", json={"model_path": "/no/such.onnx"}, headers=AUTH)
    assert missing.status_code == 409 and "no model file" in missing.json()["detail"]
    models = client.get("/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["enc"]
    assert client.get("/v1/models/enc", headers=AUTH).json() == models["data"][0]
    missing_model = client.get("/v1/models/nope", headers=AUTH)
    assert missing_model.status_code == 404
    assert missing_model.json()["error"]["code"] == "model_not_found"
    no_token = client.get("/v1/models")
    assert no_token.status_code == 401
    assert no_token.json()["error"]["code"] == "invalid_api_key"
    paths = client.get("/openapi.json", headers=AUTH).json()["paths"]
    assert {"/v1/embeddings", "/v1/infer", "/v1/deployments"} <= set(paths)


def test_input_checks_and_pooling_helpers() -> None:
    feeds = check_inputs(INPUTS, GOOD)
    assert feeds["input_ids"].dtype == np.int64 and feeds["mask"].dtype == np.float32
    with pytest.raises(RequestError, match="extra"):
        check_inputs(INPUTS, {**GOOD, "other": [1]})
    hidden = np.array([[[1.0, 0.0], [0.0, 1.0], [9.0, 9.0]]], np.float32)
    pooled = mean_pool(hidden, np.array([[1, 1, 0]]))
    np.testing.assert_allclose(pooled, [[2**-0.5, 2**-0.5]], rtol=1e-6)
    assert model_id_of(Path("/x/all-MiniLM-L6-v2.onnx")) == "all-minilm-l6-v2"


def test_speculative_decoding_is_set_per_model_and_kept(client: TestClient) -> None:
    def put(model: str, body: object) -> int:
        route = f"/v1/deployments/{model}/speculative"
        return client.put(route, json=body, headers=AUTH).status_code

    [record] = client.get("/v1/deployments", headers=AUTH).json()
    assert record["speculative"] == "auto"  # the default
    assert put("enc", {"speculative": "off"}) == 200
    assert put("enc", {"speculative": "sometimes"}) == 400
    assert put("nope", {"speculative": "lookup"}) == 404
    assert put("enc", {"speculative": "draft"}) == 400  # no draft model to draft with
    assert (
        client.put("/v1/deployments/enc/speculative", json={"speculative": "off"}).status_code
        == 401
    )
    [record] = client.get("/v1/deployments", headers=AUTH).json()
    assert record["speculative"] == "off"
