"""The demo's GGUF route: planning caps from the file's header, under half of its weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.demo.gguf import PACKAGED, SHARE, gguf_caps, packaged_gguf, stored_bytes
from devtools.demo.steps import DemoStepError
from devtools.gguf_files import SPECS, write_gguf

NAMES = ("nas", "laptop", "sbc", "desktop")


def test_caps_hold_under_half_of_the_stored_weights(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "qwen2.gguf", SPECS["qwen2"], "q4_k_m")
    stored = stored_bytes(path)
    assert stored > 0
    caps = gguf_caps(path, NAMES, budget_bytes=1 << 30)
    assert set(caps) == set(NAMES)
    assert all(cap == int(SHARE * stored) and 2 * cap < stored for cap in caps.values())
    assert sum(caps.values()) > stored  # the four agents together can hold it


def test_caps_never_exceed_an_agents_budget(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "llama.gguf", SPECS["llama"], "f32")
    caps = gguf_caps(path, NAMES, budget_bytes=1000)
    assert set(caps.values()) == {1000}


def test_stored_bytes_follow_the_weights_mode(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "f32.gguf", SPECS["llama"], "f32")
    assert stored_bytes(path, "int4") < stored_bytes(path, "int8") < stored_bytes(path, "keep")


def test_only_packaged_models_have_a_file(tmp_path: Path) -> None:
    assert {"gemma3-270m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"} <= PACKAGED
    with pytest.raises(DemoStepError, match="tiny-llama has no packaged GGUF file"):
        packaged_gguf("tiny-llama", tmp_path)
