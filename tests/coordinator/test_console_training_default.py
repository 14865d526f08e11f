"""The console's Training page starts a run of a served model by default (issue 41 item 6: it
defaulted to "training target (digits task)", which the demo no longer has).

The page's options are built in ``live.js``; the browser test drives it end to end, this one
holds the order of the options without a browser.
"""

from __future__ import annotations

from pathlib import Path

LIVE_JS = Path(__file__).resolve().parents[2] / "coordinator" / "console" / "static" / "live.js"


def test_served_models_come_before_the_training_target() -> None:
    source = LIVE_JS.read_text(encoding="utf-8")
    call = source.split('fillSelect($("train-model"), [', 1)[1].split("]", 1)[0]
    served = call.index("...served.map")
    target = call.index("--training-target")
    assert served < target, call
    assert "digits task" not in source
