"""The steps of the interim ``fedshard demo``, each printing what it shows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Console

from partitioner.frontdoor import export_minilm
from partitioner.split import SplitOptions, split_model
from partitioner.split_cli import print_split
from protocols.devices import DeviceList, DeviceSpec
from protocols.frames import FrameHeader, decode_frame, encode_frame

BUDGET_SHARES = {"nas": 0.60, "laptop": 0.30, "sbc": 0.30}
"""Memory budgets as shares of MiniLM's weights: no device holds it alone, all three together do."""
GFLOPS = {"nas": 20.0, "laptop": 40.0, "sbc": 5.0}


def plan_and_split_minilm(console: Console, workdir: Path) -> Path:
    """Export MiniLM, split it across three uneven devices and verify the chain; returns DIR."""
    model = workdir / "minilm.onnx"
    with console.status("exporting all-MiniLM-L6-v2 from its package (real weights)..."):
        export_minilm(model)
    weights = sum(f.stat().st_size for f in workdir.iterdir() if f.name.startswith("minilm"))
    devices = DeviceList(
        devices=[
            DeviceSpec(
                name=name,
                memory_bytes=int(weights * share),
                gflops=GFLOPS[name],
                bandwidth_mbps=1000,
            )
            for name, share in BUDGET_SHARES.items()
        ]
    )
    out = workdir / "segments"
    with console.status("planning and cutting into segments, then verifying the chain..."):
        result = split_model(model, devices, out, SplitOptions(verify=True))
    print_split(console, result, devices)
    return out


def frame_round_trip(console: Console) -> None:
    """Move a 1 MiB activation through the frame codec and check it arrives intact."""
    hidden = np.random.default_rng(0).standard_normal((1, 128, 2048), dtype=np.float32)
    frame = encode_frame(FrameHeader(request_id="demo-1", segment_index=1), {"hidden": hidden})
    decoded = decode_frame(frame).tensors["hidden"]
    same = np.array_equal(decoded, hidden)
    console.print(
        f"activation frame: {len(frame):,} bytes for a {hidden.nbytes:,}-byte tensor, "
        f"decoded without a copy, identical: {same}"
    )
