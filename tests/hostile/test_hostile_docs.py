"""Hostile API reads, second round: the API's own description needs the token.

``/docs`` and ``/openapi.json`` were served to anyone, listing every route to try. The API guard
now answers them 401 without the bearer token, unless the operator opens them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.app import Services, create_app
from coordinator.http.guard import DOC_PATHS, ApiGuard
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing

TOKEN = "tok"


def test_the_description_needs_the_token(tmp_path: Path) -> None:
    pairing = Pairing(tmp_path, CertificateAuthority.open(tmp_path))
    app = create_app(Services(TOKEN, DeviceRegistry(), pairing))
    with TestClient(app) as api:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert api.get(path).status_code == 401, path
            assert api.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert api.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        # the console page itself needs no token (it reads ?token= in the browser)
        assert api.get("/").status_code == 200
    opened = create_app(Services(TOKEN, DeviceRegistry(), pairing, open_docs=True))
    with TestClient(opened) as api:
        assert api.get("/openapi.json").status_code == 200
        assert api.get("/v1/devices").status_code == 401


@pytest.mark.parametrize("open_docs", [False, True])
def test_the_operator_may_open_the_description(open_docs: bool) -> None:
    app = FastAPI()
    app.add_middleware(ApiGuard, token=TOKEN, open_docs=open_docs)
    with TestClient(app) as api:
        assert api.get("/openapi.json").status_code == (200 if open_docs else 401)
        assert api.get("/v1/anything").status_code == 401  # the API itself stays closed
    assert "/openapi.json" in DOC_PATHS
