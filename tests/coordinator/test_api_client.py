"""The typed client of the coordinator's API (:mod:`coordinator.client`) and the CLI verbs on it.

One real app (``create_app`` over a real pairing book and registry, no agents) served by
uvicorn on 127.0.0.1 in a thread: the client returns the API's own models, a refusal is an
:class:`~coordinator.errors.ApiError` with the status and the reply's detail, no answer is
status 0, and ``fedshard devices``/``pair``/``revoke`` print what they printed before.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from pairing_helpers import make_csr, request_code

from coordinator import commands
from coordinator.client import CoordinatorClient, Reply
from coordinator.errors import ApiError
from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.app import Services, create_app
from coordinator.http.device_models import DeviceView
from coordinator.http.replies import CompletionChunk, EmbeddingsReply, FailoverView
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing
from devtools.demo.steps import Api
from protocols.profile import Announcement, DeviceProfile

TOKEN = "client-token"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[str, Services]]:
    services = Services(
        token=TOKEN,
        registry=DeviceRegistry(),
        pairing=Pairing(tmp_path, CertificateAuthority.open(tmp_path)),
    )
    port = _free_port()
    config = uvicorn.Config(create_app(services), host="127.0.0.1", port=port, log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", services
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _announce(services: Services, name: str, fingerprint: str) -> None:
    profile = DeviceProfile(
        device_id="ab" * 8,
        name=name,
        memory_bytes=1 << 30,
        gflops=3.0,
        control_port=9000,
        data_port=9001,
        cert_fingerprint=fingerprint,
    )
    services.registry.announce(Announcement(profile=profile), "127.0.0.1", f"{name}-svc")


def _args(url: str, **more: object) -> argparse.Namespace:
    return argparse.Namespace(coordinator=url, token=TOKEN, **more)


def test_the_client_returns_the_apis_models_and_typed_refusals(
    api: tuple[str, Services],
) -> None:
    url, services = api
    client = CoordinatorClient(url, TOKEN)
    assert client.devices() == []
    code = request_code(services.pairing, "nas", make_csr("nas"))
    with pytest.raises(ApiError) as wrong:
        client.approve("nas", "AAAA-AAAA")
    assert wrong.value.status == 403 and wrong.value.detail
    approved = client.approve("nas", code)
    assert approved.name == "nas"
    _announce(services, "nas", approved.fingerprint)
    [device] = client.devices()
    assert isinstance(device, DeviceView) and (device.name, device.status) == ("nas", "paired")
    assert client.revoke("nas").revoked == "nas"
    assert [d.status for d in client.devices()] == ["revoked"]
    with pytest.raises(ApiError) as ghost:
        client.revoke("ghost")
    assert ghost.value.status == 404
    with pytest.raises(ApiError) as refused:
        CoordinatorClient(url, "wrong").devices()
    assert refused.value.status == 401
    assert client.call("GET", "/v1/devices").status == 200  # the raw reply, for any route


def test_no_answer_is_status_zero_with_the_reason() -> None:
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    with pytest.raises(ApiError) as lost:
        CoordinatorClient(url, TOKEN, timeout=5).devices()
    assert lost.value.status == 0
    assert f"cannot reach the coordinator at {url}" in str(lost.value.detail)


def test_the_cli_verbs_print_what_the_api_answered(
    api: tuple[str, Services], capsys: pytest.CaptureFixture[str]
) -> None:
    url, services = api
    code = request_code(services.pairing, "sbc", make_csr("sbc"))
    assert commands.run_pair(_args(url, name="sbc", code=code, wait=0.0)) == 0
    assert "paired sbc" in capsys.readouterr().out
    fingerprint = services.pairing.book().paired[0].fingerprint
    _announce(services, "sbc", fingerprint)
    assert commands.run_devices(_args(url)) == 0
    table = capsys.readouterr().out
    assert "sbc" in table and "paired" in table and "1024 MiB" in table
    assert commands.run_revoke(_args(url, name="ghost")) == 1
    assert "error (404)" in capsys.readouterr().out
    lost = f"http://127.0.0.1:{_free_port()}"
    assert commands.run_devices(_args(lost)) == 1
    assert "error (no connection)" in capsys.readouterr().out


def test_the_demos_api_handle_is_the_clients_call(api: tuple[str, Services]) -> None:
    url, _ = api
    demo = Api(url, TOKEN)
    assert demo.call("GET", "/v1/devices") == (200, [])
    code, reply = demo.call("POST", "/v1/pairing/revoke", {"name": "ghost"})
    assert code == 404 and reply["detail"]
    assert Api(url, "wrong").call("GET", "/v1/devices")[0] == 401
    with pytest.raises(httpx.HTTPError):  # no answer: raised, so that the demo can retry
        Api(f"http://127.0.0.1:{_free_port()}", TOKEN).call("GET", "/v1/devices", timeout=5)


def test_one_connection_pool_in_a_block_and_typed_refusals_of_routes_not_served(
    api: tuple[str, Services],
) -> None:
    url, services = api
    request_code(services.pairing, "cam", make_csr("cam"))
    with CoordinatorClient(url, TOKEN) as client:
        assert [p.name for p in client.pairing().pending] == ["cam"]
        assert client.console_models() == []
        with pytest.raises(ApiError) as no_serving:  # no deployments without serving
            client.deployments()
        assert no_serving.value.status == 404
        with pytest.raises(ApiError) as unknown:
            client.embeddings("enc", "hello")
        assert unknown.value.status == 404 and unknown.value.detail
        with pytest.raises(ApiError) as refused:
            list(client.stream("/v1/completions", {"model": "dec", "prompt": "hi"}))
        assert refused.value.status == 404 and refused.value.detail
    assert client.call("GET", "/v1/devices").status == 200  # after the block: one-off calls
    with pytest.raises(ApiError) as lost:
        list(CoordinatorClient(f"http://127.0.0.1:{_free_port()}", TOKEN).stream("/x", {}))
    assert lost.value.status == 0


def test_the_reply_models_read_what_the_routes_write() -> None:
    reply = EmbeddingsReply.model_validate(
        {
            "object": "list",
            "model": "enc",
            "data": [
                {"object": "embedding", "index": 1, "embedding": [0.5, 0.25]},
                {"object": "embedding", "index": 0, "embedding": [1.0, 0.0]},
            ],
            "usage": {"prompt_tokens": 3, "total_tokens": 3},
            "plan_version": 2,
        }
    )
    assert reply.vectors() == [[1.0, 0.0], [0.5, 0.25]] and reply.plan_version == 2
    chat = CompletionChunk.model_validate({"choices": [{"delta": {"content": "Hi"}}]})
    text = CompletionChunk.model_validate({"choices": [{"text": " there", "index": 0}]})
    assert (chat.text(), text.text(), CompletionChunk().text()) == ("Hi", " there", "")
    view = FailoverView.model_validate(
        {
            "enabled": True,
            "models": {"m": {"state": "recovering", "plan_version": 3, "reason": "lost a"}},
            "events": [{"at": 1.0, "kind": "lost", "device": "a"}],
        }
    )
    assert view.models["m"].state == "recovering" and view.events[0].device == "a"


def test_a_transport_carries_the_requests_and_openai_refusals_have_their_message() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/embeddings":
            error = {"message": "no model 'nope' is deployed", "code": "model_not_found"}
            return httpx.Response(404, json={"error": error})
        return httpx.Response(200, json=[])

    client = CoordinatorClient("http://lab:8470", TOKEN, transport=httpx.MockTransport(answer))
    assert client.devices() == []
    assert seen[0].headers["authorization"] == f"Bearer {TOKEN}"
    with pytest.raises(ApiError) as refused:
        client.embeddings("nope", "x")
    assert (refused.value.status, refused.value.detail) == (404, "no model 'nope' is deployed")
    assert Reply(503, {"detail": "busy"}).detail == "busy" and Reply(500, "text").detail is None
