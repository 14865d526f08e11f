"""One error catalogue: every route family answers an error class with the same status.

Three families of the real app (``create_app``) raise each catalogued error: the core API
(``GET /v1/pairing``, ``{"detail"}`` bodies), the training routes (``POST /v1/training/runs``)
and the OpenAI routes (``POST /v1/chat/completions``, ``{"error"}`` bodies).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from coordinator.errors import (
    AgentRefusedError,
    CapacityError,
    ContextLengthError,
    CoordinatorError,
    TooManyAttemptsError,
    UnavailableError,
)
from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.app import Services, create_app
from coordinator.http.errors import CATALOGUE, INTERNAL, entry_of
from protocols.errors import ControlErrorCode

TOKEN = "catalogue-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _instance(kind: type[CoordinatorError]) -> CoordinatorError:
    """An instance of ``kind`` with a recognisable message."""
    if issubclass(kind, ContextLengthError):
        return kind(16, 10, 10)
    if issubclass(kind, TooManyAttemptsError | CapacityError | UnavailableError):
        return kind(f"{kind.__name__} happened", 2.5)
    if issubclass(kind, AgentRefusedError):
        return kind("d1", 500, ControlErrorCode.REFUSED, "agent said no")
    return kind(f"{kind.__name__} happened")


class Raising:
    """Stands in for the pairing book, the training runs and the model lookup: it raises."""

    def __init__(self) -> None:
        self.error: Exception = RuntimeError("unset")

    def book(self) -> Any:
        raise self.error

    async def start(self, body: Any) -> str:
        raise self.error

    def __call__(self, name: str) -> Any:
        raise self.error


def _client(tmp_path: Path) -> tuple[TestClient, Raising]:
    raising = Raising()
    services = Services(
        token=TOKEN,
        registry=DeviceRegistry(),
        pairing=raising,  # type: ignore[arg-type]
        generation=raising,
        training=raising,  # type: ignore[arg-type]
    )
    return TestClient(create_app(services), raise_server_exceptions=False), raising


FAMILIES: dict[str, Callable[[TestClient], Response]] = {
    "core": lambda c: c.get("/v1/pairing", headers=AUTH),
    "training": lambda c: c.post("/v1/training/runs", json={"rounds": 1}, headers=AUTH),
    "openai": lambda c: c.post("/v1/chat/completions", json=CHAT, headers=AUTH),
}


def _message(response: Response) -> str:
    body = response.json()
    return str(body["error"]["message"] if "error" in body else body["detail"])


@pytest.mark.parametrize("kind", [kind for kind, _ in CATALOGUE], ids=lambda k: k.__name__)
def test_every_family_answers_an_error_class_with_its_catalogue_status(
    tmp_path: Path, kind: type[CoordinatorError]
) -> None:
    client, raising = _client(tmp_path)
    raising.error = _instance(kind)
    entry = entry_of(raising.error)
    answers = {name: call(client) for name, call in FAMILIES.items()}
    assert {name: r.status_code for name, r in answers.items()} == dict.fromkeys(
        FAMILIES, entry.status
    )
    assert {_message(r) for r in answers.values()} == {str(raising.error)}
    retry = {r.headers.get("Retry-After") for r in answers.values()}
    assert retry == ({"3"} if hasattr(raising.error, "retry_after_s") else {None})
    openai = answers["openai"].json()["error"]
    assert (openai["type"], openai["code"]) == (entry.type, entry.code)


def test_the_catalogue_shadows_no_entry() -> None:
    """Most specific first: no class is listed after one of its base classes."""
    kinds = [kind for kind, _ in CATALOGUE]
    for i, kind in enumerate(kinds):
        assert not any(issubclass(kind, earlier) for earlier in kinds[:i]), kind
    assert len({kind for kind in kinds}) == len(kinds)


def test_unexpected_errors_are_500_everywhere_and_say_nothing(tmp_path: Path) -> None:
    client, raising = _client(tmp_path)
    raising.error = RuntimeError("secret internals")
    answers = [call(client) for call in FAMILIES.values()]
    assert [r.status_code for r in answers] == [500, 500, 500]
    assert {_message(r) for r in answers} == {INTERNAL}


def test_a_malformed_body_is_400_in_every_family(tmp_path: Path) -> None:
    client, _ = _client(tmp_path)
    training = client.post("/v1/training/runs", json={"rounds": 0}, headers=AUTH)
    chat = client.post("/v1/chat/completions", json={"model": "m"}, headers=AUTH)
    approve = client.post("/v1/pairing/approve", json={"name": "x"}, headers=AUTH)
    assert [training.status_code, chat.status_code, approve.status_code] == [400, 400, 400]
    assert "rounds" in training.json()["detail"] and "code" in approve.json()["detail"]
    assert chat.json()["error"]["param"] == "messages"
