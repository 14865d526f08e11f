"""schemathesis against the coordinator's own OpenAPI schema, in process (ASGI, no sockets).

Every operation the app mounts is called with generated valid and invalid requests, with the
bearer token: no answer may be a 5xx, every status and body must be what the schema declares,
and every error body is ``{"detail": ...}`` without a stack trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from coordinator.deploy.deployer import Deployer
from coordinator.deploy.store import DeploymentStore
from coordinator.fleet.links import LinkMeter
from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.app import Services, create_app
from coordinator.http.serving import Serving
from coordinator.serving.embeddings import Embedder
from coordinator.serving.router import Router
from coordinator.transport.agent_client import AgentClient
from coordinator.transport.dataplane import DataPlane
from coordinator.transport.tls import client_context
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.identity import open_identity
from coordinator.trust.pairing import Pairing

TOKEN = "schemathesis-token"
EXAMPLES = 15
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
"""Not ``negative_data_rejection``: it counts an ignored unknown query parameter as accepting
bad data, and ignoring those is ordinary HTTP. Invalid bodies are still generated (the
negative mode) and must get a documented 4xx, never a 5xx."""


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastAPI]:
    """The app as ``fedshard coordinator`` builds it, with no agent online."""
    state = tmp_path_factory.mktemp("coordinator")
    ca = CertificateAuthority.open(state)
    ctx = client_context(open_identity(state, ca))
    store = DeploymentStore(state)
    plane = DataPlane()
    router = Router(store, plane, ctx)
    agents = AgentClient(ctx)
    deployer = Deployer(state, store, agents, list, list, ca.sign, router.health)
    serving = Serving(store, deployer, router, Embedder(store, router), LinkMeter(agents, list))
    services = Services(TOKEN, DeviceRegistry(), Pairing(state, ca), None, serving)
    try:
        yield create_app(services)
    finally:
        router.close()
        plane.close()


@pytest.fixture(scope="module")
def api_schema(app: FastAPI) -> schemathesis.BaseSchema:
    """The app's own OpenAPI document, loaded by schemathesis over ASGI."""
    auth = {"Authorization": f"Bearer {TOKEN}"}  # the description needs the token too
    return schemathesis.openapi.from_asgi("/openapi.json", app, headers=auth)


def _operations(schema: schemathesis.BaseSchema) -> list[schemathesis.APIOperation]:
    """Every operation, but server-sent event streams (documented as such): they stream for
    seconds by design, which a buffered in-process client cannot fuzz quickly."""
    return [
        op
        for op in (result.ok() for result in schema.get_all_operations())
        if "text/event-stream" not in json.dumps(op.definition.raw.get("responses", {}))
    ]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_conforms_to_its_schema(
    api_schema: schemathesis.BaseSchema, mode: GenerationMode
) -> None:
    operations = _operations(api_schema)
    assert len(operations) >= 12  # every router mounted under /v1

    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            response = case.call_and_validate(headers=AUTH, checks=CHECKS)
            if response.status_code >= 400:
                assert "Traceback" not in response.text

        check()


@pytest.mark.parametrize(
    "model_path", ["a\u0000b", "~no-such-user-here/model.onnx"], ids=["nul", "unknown-user"]
)
def test_unusable_model_paths_are_400_not_500(app: FastAPI, model_path: str) -> None:
    """Found by hand next to schemathesis: both used to escape as 500."""
    client = TestClient(app, raise_server_exceptions=False)
    response = client.post("/v1/deployments", json={"model_path": model_path}, headers=AUTH)
    assert response.status_code == 400
    assert response.json()["detail"].startswith("model_path is not a usable path")
