"""follow_run: the one poll loop behind both ServerApps' runs (Flower's status is faked)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.training import polling
from coordinator.training.errors import TrainingRunError


@pytest.fixture
def link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(polling, "POLL_S", 0.0)
    monkeypatch.setattr(polling, "STATUS_EVERY_S", 0.0)
    log = tmp_path / "superlink.log"
    log.write_text("ServerApp crashed: boom\n")
    return SimpleNamespace(process=SimpleNamespace(poll=lambda: None), log_path=log)


def _follow(link: Any, records: list[int | None], run_id: int | None = 7, **kw: Any) -> int:
    feed = iter(records)
    return polling.follow_run(
        link,
        run_id,
        lambda: next(feed, None),
        lambda r: r if r >= 3 else None,
        timeout_s=kw.get("timeout_s", 30.0),
        should_stop=kw.get("should_stop", lambda: False),
    )


def test_returns_what_take_accepts(link: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(polling, "run_status", lambda link, run_id: "running")
    assert _follow(link, [None, 1, 2, 3]) == 3


def test_a_run_flower_ended_otherwise_fails_with_the_log(
    link: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(polling, "run_status", lambda link, run_id: "finished:failed")
    with pytest.raises(TrainingRunError, match=r"ended finished:failed: .*boom"):
        _follow(link, [1, 1, 1, 1])


def test_completed_without_a_finished_record_fails(
    link: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(polling, "run_status", lambda link, run_id: "finished:completed")
    with pytest.raises(TrainingRunError, match="completed without a finished record"):
        _follow(link, [1, 2])


def test_without_a_run_id_flower_is_not_asked(link: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(link: Any, run_id: int) -> str:
        raise AssertionError("asked")

    monkeypatch.setattr(polling, "run_status", never)
    with pytest.raises(TrainingRunError, match="the run was stopped"):
        _follow(link, [1], run_id=None, should_stop=lambda: True)


def test_the_deadline_holds(link: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(polling, "run_status", lambda link, run_id: "running")
    with pytest.raises(TrainingRunError, match="did not finish within 0 s"):
        _follow(link, [1] * 1000, timeout_s=0.0)
