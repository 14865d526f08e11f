"""The ``fedshard`` command stays light: an edge device with only ``fedshard[agent]`` (no onnx,
no torch, no Flower) can build its parser and run ``fedshard agent``."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("onnx", "torch", "flwr", "transformers", "fastapi")
CHECK = (
    "import sys, fedshard.cli as c; c.build_parser(); "
    f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
)


def test_building_the_parser_imports_no_heavy_package() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "", f"imported at start: {done.stdout.strip()}"
