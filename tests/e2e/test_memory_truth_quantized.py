"""Predicted memory against what the agent keeps resident, for int4 segments of a real model.

Gemma 3 270M is stored in int4 by ONNX Runtime's quantizer, cut in three at its embedded
sample step (one session of 64 tokens reserved per stage), and each segment is deployed through
the agent's own :class:`~edge_agent.runtime.segments.SegmentStore` in a fresh process (see
``tests/e2e/test_memory_truth.py``). The prediction must be within 0.85-1.15x of the measurement.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
BAND = (0.85, 1.15)


def test_int4_segments_predicted_within_the_band_of_what_agents_hold(
    gemma_export_dir: Path, tmp_path: Path
) -> None:
    from test_memory_truth import _segment_inputs

    from partitioner.analysis.modelio import initializer_bytes, load_model
    from partitioner.analysis.samples import SAMPLE_INPUTS_KEY, decode_samples
    from partitioner.cutting.inputs import SplitOptions
    from partitioner.cutting.split import split_model
    from partitioner.models.decoders.precision import quantize_decoder
    from protocols.devices import DeviceList
    from protocols.manifest import SessionLimits

    export = tmp_path / "int4"
    quantize_decoder(gemma_export_dir, export, "int4")
    model = load_model(export / "model.onnx")
    # int4 products of int8 activations keep two more copies of their scales once loaded
    # (partitioner.analysis.runtime_memory.PACKED_SCALE_COPIES): a little over half of the stored
    # size
    budget = int(initializer_bytes(model) * 0.56)
    devices = DeviceList.from_obj(
        {
            "devices": [
                {"name": f"d{i}", "memory_bytes": budget, "gflops": 50.0, "bandwidth_mbps": 1e3}
                for i in range(3)
            ]
        }
    )
    out = tmp_path / "split"
    options = SplitOptions(sessions=SessionLimits(max_sessions=1, max_context=64), carry_io=False)
    manifest = split_model(export / "model.onnx", devices, out, options).manifest
    assert len(manifest.segments) == 3
    samples = {p.key: p.value for p in model.metadata_props}[SAMPLE_INPUTS_KEY]
    for seg, feeds in zip(
        manifest.segments, _segment_inputs(out, decode_samples(samples)), strict=True
    ):
        warmup = out / f"warmup{seg.index}.npz"
        np.savez(warmup, **feeds)  # type: ignore[arg-type]
        script = REPO / "tests" / "e2e" / "test_memory_truth.py"
        args = [str(out), str(seg.index), str(warmup), str(budget)]
        done = subprocess.run(
            [sys.executable, str(script), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])["report"]
        ratio = seg.predicted_memory_bytes / report["measured_memory_bytes"]
        assert BAND[0] <= ratio <= BAND[1], (seg.index, seg.predicted_memory_bytes, report)
