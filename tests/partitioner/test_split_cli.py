"""``fedshard split`` / ``fedshard export`` handlers: exit codes, output, files written."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from graph_helpers import block_stack, kitchen_feeds, kitchen_sink

from hostkit.files import file_sha256
from partitioner.analysis.runtime_memory import RuntimeMemory
from partitioner.cli import split_cli
from partitioner.models.frontdoor import ExportResult
from protocols.manifest import Manifest

RUNTIME_ROOM = RuntimeMemory().stage_bytes(1 << 20)
"""What ONNX Runtime needs per segment beyond weights, for these models' small workspaces."""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fedshard")
    split_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def _run(argv: list[str]) -> int:
    args = _parse(argv)
    code: int = args.run(args)
    return code


@pytest.fixture
def stack_model(tmp_path: Path) -> Path:
    path = tmp_path / "stack.onnx"
    onnx.save(block_stack(8, width=128), str(path))
    return path


def _devices(tmp_path: Path, budgets: list[int], **extra: Any) -> Path:
    doc = {
        "devices": [
            {"name": f"n{i}", "memory_bytes": b, "gflops": 5.0, "bandwidth_mbps": 100.0}
            for i, b in enumerate(budgets)
        ],
        **extra,
    }
    path = tmp_path / "devices.json"
    path.write_text(json.dumps(doc))
    return path


def test_split_writes_segments_manifest_and_prints_the_plan(
    stack_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = 8 * 2 * 128 * 256 * 4
    budget = int(0.4 * weights) + RUNTIME_ROOM  # two devices cannot hold it, three can
    devices = _devices(
        tmp_path,
        [budget, budget, budget],
        links=[{"a": "n0", "b": "n1", "bandwidth_mbps": 50.0, "latency_ms": 2.0}],
    )
    out = tmp_path / "out"
    code = _run(
        ["split", str(stack_model), "--devices", str(devices), "--out", str(out), "--verify"]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    manifest = Manifest.from_json((out / "manifest.json").read_text())
    assert len(manifest.segments) == 3
    assert manifest.model.sha256 == file_sha256(stack_model)
    for seg in manifest.segments:
        assert seg.sha256 == file_sha256(out / seg.file)
        assert seg.param_bytes <= weights // 2
        assert seg.predicted_compute_s > 0
    assert "verified" in printed and "max abs diff" in printed
    assert "n0" in printed and "budget" in printed


def test_split_counts_the_requester_link(
    stack_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """n0 and n1 each hold the model; the requester reaches n0 only over a crawl, so the
    latency plan puts everything on n1 and prints the input and result transfers."""
    slow = {"links": [{"device": "n0", "bandwidth_mbps": 0.01}]}
    devices = _devices(tmp_path, [10**9, 10**9], requester=slow)
    out = tmp_path / "out"
    argv = ["split", str(stack_model), "--devices", str(devices), "--out", str(out)]
    assert _run([*argv, "--objective", "latency"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    manifest = Manifest.from_json((out / "manifest.json").read_text())
    assert [seg.device for seg in manifest.segments] == ["n1"]
    assert "(input in " in printed and " ms, result back " in printed


def test_infeasible_split_says_by_how_much(
    stack_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    devices = _devices(tmp_path, [100_000, 100_000])
    out = tmp_path / "out"
    code = _run(["split", str(stack_model), "--devices", str(devices), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == split_cli.EXIT_INFEASIBLE
    assert "infeasible" in printed and "bytes" in printed
    assert not (out / "manifest.json").exists()


def test_verification_failure_exits_non_zero_without_a_manifest(
    stack_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    devices = _devices(tmp_path, [10**9])
    out = tmp_path / "out"
    argv = ["split", str(stack_model), "--devices", str(devices), "--out", str(out)]
    code = _run([*argv, "--verify", "--tolerance", "-1"])
    assert code == split_cli.EXIT_VERIFY_FAILED
    assert "verification failed" in capsys.readouterr().out
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize(
    ("devices_text", "model_name"),
    [
        ('{"devices": []}', "stack.onnx"),
        ("not json", "stack.onnx"),
        (
            '{"devices": [{"name": "a", "memory_bytes": 1, "gflops": 1, "bandwidth_mbps": 1}]}',
            "nope.onnx",
        ),
    ],
)
def test_bad_input_exits_one_with_a_message(
    stack_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    devices_text: str,
    model_name: str,
) -> None:
    devices = tmp_path / "devices.json"
    devices.write_text(devices_text)
    model = stack_model.parent / model_name
    code = _run(["split", str(model), "--devices", str(devices), "--out", str(tmp_path / "o")])
    assert code == split_cli.EXIT_BAD_INPUT
    assert "error" in capsys.readouterr().out


def test_direct_io_dims_and_sample_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "ks.onnx"
    onnx.save(kitchen_sink(blocks=4), str(model))
    samples = tmp_path / "samples.npz"
    np.savez(samples, **kitchen_feeds(n=6))
    devices = _devices(tmp_path, [10**6 + RUNTIME_ROOM, 10**6 + RUNTIME_ROOM])
    out = tmp_path / "out"
    argv = ["split", str(model), "--devices", str(devices), "--out", str(out), "--verify"]
    code = _run(
        [*argv, "--direct-io", "--inputs", str(samples), "--dim", "n=3", "--max-units", "4"]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    manifest = Manifest.from_json((out / "manifest.json").read_text())
    assert manifest.segments[-1].units[1] <= 4
    assert "'n': 3" in printed  # --dim wins over the sample file's shape for costing
    assert _run([*argv, "--dim", "n=zero"]) == split_cli.EXIT_BAD_INPUT


def test_export_handler_reports_the_front_door_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[Path, bool]] = []

    def fake(out: Path, *, pooled: bool = False) -> ExportResult:
        calls.append((out, pooled))
        return ExportResult(out, ("last_hidden_state",), 1e-6, 1234)

    from partitioner.models import frontdoor

    monkeypatch.setitem(frontdoor.FRONT_DOORS, "minilm", fake)
    target = tmp_path / "m.onnx"
    assert _run(["export", "minilm", str(target), "--pooled"]) == 0
    assert calls == [(target, True)]
    assert "last_hidden_state" in capsys.readouterr().out


def test_console_script_runs_split(stack_model: Path, tmp_path: Path) -> None:
    devices = _devices(tmp_path, [10**9])
    out = tmp_path / "out"
    fedshard = Path(sys.executable).parent / "fedshard"
    if not fedshard.exists():
        pytest.skip("the fedshard console script is not installed in this environment")
    done = subprocess.run(
        [str(fedshard), "split", str(stack_model), "--devices", str(devices), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "segment0.onnx").exists() and (out / "manifest.json").exists()


def test_importing_the_cli_module_is_light() -> None:
    code = (
        "import sys; import partitioner.cli.split_cli; "
        "heavy = {'onnx', 'onnxruntime', 'torch', 'transformers'} & set(sys.modules); "
        "print(sorted(heavy))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
