"""The console's what-if for a version built from a GGUF file: planned from the file's header.

A small random Llama GGUF is deployed without agents (:func:`gguf_split_and_run`) onto three
devices too small for it alone; the version is put in a real deployment store behind the
coordinator's routes (FastAPI's TestClient). The what-if gives the deploy's own plan on the
same devices, re-plans on changed budgets and without devices, names the file's units, and
answers 409 with the shortfall where nothing fits.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from gguf_lab import write_tiny
from test_console_api import AUTH, TOKEN, _pair, _version

from coordinator.deploy.cutting import DeployCommand
from coordinator.deploy.gguf_cut import gguf_split_and_run, header_of, model_card
from coordinator.deploy.gguf_what_if import gguf_unit_names, gguf_what_if
from coordinator.deploy.store import DeploymentStore
from coordinator.errors import DeployError
from coordinator.fleet.links import LinkMeter
from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.app import Services, create_app
from coordinator.http.serving import Serving
from coordinator.serving.embeddings import Embedder
from coordinator.transport.agent_client import AgentClient
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing
from protocols.devices import DeviceList
from protocols.plan import Objective

MIB = 1 << 20
CAP = 13 * MIB
"""Per-device memory the tiny Llama (three float32 blocks and their KV cache) needs two or
three of (tests/coordinator/test_gguf_deploy.py)."""
NAMES = ("a", "b", "c")


def _devices(memory: int, names: tuple[str, ...] = NAMES) -> DeviceList:
    return DeviceList.from_obj(
        {
            "devices": [
                {"name": n, "memory_bytes": memory, "gflops": 20.0, "bandwidth_mbps": 1000.0}
                for n in names
            ]
        }
    )


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[tuple[int, int]]]:
    """The file, the version's directory and its deploy's stages as unit ranges."""
    tmp = tmp_path_factory.mktemp("gguf-what-if")
    path = write_tiny(tmp / "tiny.gguf")
    out = tmp / "deployments" / "tiny" / "v1"
    outcome = gguf_split_and_run(DeployCommand(path, "tiny"), _devices(CAP), out)
    stages = [s.units for s in outcome.manifest.segments]
    assert len(stages) >= 2
    return path, tmp, stages


def test_the_what_if_on_the_deploys_devices_is_the_deploys_plan(
    deployed: tuple[Path, Path, list[tuple[int, int]]],
) -> None:
    path, _, stages = deployed
    plan, names = gguf_what_if(path, _devices(CAP), Objective.THROUGHPUT, "tiny")
    assert [(s.start, s.end) for s in plan.stages] == stages
    assert names == ["embedding", "blk.0", "blk.1", "blk.2", "head"]
    assert gguf_unit_names(path) == names
    roomy, _ = gguf_what_if(path, _devices(10**9, ("a",)), Objective.THROUGHPUT, "tiny")
    [alone] = roomy.stages
    assert (alone.start, alone.end) == (0, len(names))
    with pytest.raises(DeployError, match=r"no plan fits these devices.*KV cache"):
        gguf_what_if(path, _devices(2 * MIB), Objective.THROUGHPUT, "tiny")


def _app(tmp: Path, path: Path, stages: list[tuple[int, int]]) -> TestClient:
    store = DeploymentStore(tmp)
    agents = AgentClient(ssl.create_default_context())
    serving = Serving(store, None, None, Embedder(store, None), LinkMeter(agents, lambda: []))  # type: ignore[arg-type]
    services = Services(
        token=TOKEN,
        registry=DeviceRegistry(),
        pairing=Pairing(tmp, CertificateAuthority.open(tmp)),
        serving=serving,
        agents=agents,
        state_dir=tmp,
    )
    for name in NAMES:
        _pair(services, name, CAP)
    devices = list(NAMES[: len(stages)])
    version = _version(path, devices, [0.001] * len(stages)).model_copy(
        update={"model_id": "tiny", "card": model_card(header_of(path), path, "keep")}
    )
    store.activate(version, None)
    return TestClient(create_app(services))


def test_the_what_if_route_plans_a_gguf_version(
    deployed: tuple[Path, Path, list[tuple[int, int]]],
) -> None:
    path, tmp, stages = deployed
    client = _app(tmp, path, stages)
    answer = client.post(
        "/v1/plan/what-if",
        json={"model": "tiny", "budgets": {"a": 10**9}, "drop": ["b", "c"]},
        headers=AUTH,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    [alone] = body["what_if"]["stages"]
    assert alone["device"] == "a" and (alone["first_unit"], alone["last_unit"]) == (
        "embedding",
        "head",
    )
    assert body["what_if"]["total_units"] == 5 and body["what_if"]["plan_version"] is None
    current = body["current"]["stages"]
    assert [(s["unit_start"], s["unit_end"]) for s in current] == stages
    assert current[0]["first_unit"] == "embedding" and current[-1]["last_unit"] == "head"
    shown = client.get("/v1/plan/tiny", headers=AUTH).json()["stages"]
    assert shown[0]["first_unit"] == "embedding"
    same = client.post("/v1/plan/what-if", json={"model": "tiny"}, headers=AUTH).json()
    assert [(s["unit_start"], s["unit_end"]) for s in same["what_if"]["stages"]] == stages
    small = {n: 2 * MIB for n in NAMES}
    refused = client.post(
        "/v1/plan/what-if", json={"model": "tiny", "budgets": small}, headers=AUTH
    )
    assert refused.status_code == 409 and "no plan fits" in refused.json()["detail"]
    dropped = client.post(
        "/v1/plan/what-if", json={"model": "tiny", "drop": ["b", "c"]}, headers=AUTH
    )
    assert dropped.status_code == 409 and "KV cache" in dropped.json()["detail"]
