"""The demo says which devices a re-plan runs on, and when one of them is a device it reported
lost whose return it has not printed yet (issue 41 item 6: a re-plan "on the devices left" that
ran on the agent just lost, with no line saying it came back)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from devtools.demo.supervise import AgentSupervisor, placement_words, plan_devices

DEPLOYMENTS = [
    {
        "model_id": "m",
        "versions": [
            {"plan_version": 3, "segments": [{"device": "a"}, {"device": "b"}, {"device": "c"}]},
            {"plan_version": 5, "segments": [{"device": "a"}, {"device": "c"}]},
        ],
    }
]


class FakeApi:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events

    def get(self, path: str) -> Any:
        return {"events": self.events} if path == "/v1/failover" else DEPLOYMENTS


def test_plan_devices_in_stage_order() -> None:
    assert plan_devices(DEPLOYMENTS, "m", 5) == ["a", "c"]
    assert plan_devices(DEPLOYMENTS, "m", 9) == []
    assert plan_devices(DEPLOYMENTS, "other", 3) == []


def test_words_name_a_lost_device_that_answers_again() -> None:
    assert placement_words(["a", "c"], {"b"}) == " on a, c"
    assert placement_words(["a", "b", "c"], {"b"}) == (
        " on a, b, c (b answered again before this plan was made)"
    )
    assert placement_words([], {"b"}) == ""


def test_the_supervisor_prints_the_return_until_the_back_event() -> None:
    events: list[dict[str, Any]] = [
        {"at": 1.0, "kind": "lost", "device": "b"},
        {"at": 2.0, "kind": "replanned", "model_id": "m", "plan_version": 3},
    ]
    console = Console(record=True, width=200)
    supervisor = AgentSupervisor(console, FakeApi(events), procs=None)  # type: ignore[arg-type]
    supervisor._new_notes()
    assert "b answered again before this plan was made" in console.export_text()
    events.append({"at": 3.0, "kind": "back", "device": "b"})
    events.append({"at": 4.0, "kind": "expanded", "model_id": "m", "plan_version": 3})
    supervisor._new_notes()
    last = console.export_text().strip().splitlines()[-1]
    assert last.endswith("on a, b, c")
