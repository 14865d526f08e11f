"""The coordinator's peak resident memory while it builds a GGUF deploy, next to the file size
and the largest segment (issue 40 item 3: below the largest segment plus 300 MB).

Writes a random Llama-shaped GGUF (Q4_K_M-like mix, tensor by tensor) of the given shape, then
runs the deploy's GGUF route (:func:`coordinator.deploy.gguf_cut.gguf_split_and_run`: header,
plan, each stage's segment built, run here in ONNX Runtime and joined into one file) onto
``--stages`` devices just large enough, in a fresh process (as a coordinator would: the
writer's own memory is not counted), and prints the peak next to the sizes and next to that
process's resident memory before the build (imports, Python)::

    python bench/gguf_deploy_memory.py --layers 8 --hidden 2048 --ffn 5632 --vocab 32000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from coordinator.deploy.cutting import DeployCommand
from coordinator.deploy.gguf_cut import gguf_split_and_run, header_of
from coordinator.deploy.peak_memory import PeakMemory
from devtools.gguf_files import Spec, write_gguf
from partitioner.models.gguf.units import unit_table
from protocols.devices import DeviceList
from protocols.manifest import DEFAULT_SESSIONS

MB = 1e6


def main() -> None:
    """Write the file, build the deploy, print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--mix", default="q4_k_m")
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary dir)")
    parser.add_argument("--build", type=Path, help="only build the deploy of this GGUF file")
    args = parser.parse_args()
    if args.build is not None:
        build(args.build, args.stages, args.build.parent)
        return
    work = args.dir or Path(tempfile.mkdtemp(prefix="gguf-deploy-"))
    work.mkdir(parents=True, exist_ok=True)
    spec = Spec(
        "llama",
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        ffn=args.ffn,
        vocab=args.vocab,
    )
    path = work / "bench.gguf"
    started = time.monotonic()
    write_gguf(path, spec, args.mix)
    print(f"wrote {path.stat().st_size / MB:.1f} MB in {time.monotonic() - started:.1f} s")
    command = [sys.executable, __file__, "--build", str(path), "--stages", str(args.stages)]
    subprocess.run(command, check=True)


def build(path: Path, stages: int, work: Path) -> None:
    """Build the deploy of ``path`` onto ``stages`` devices in this process; print the peak."""
    model = header_of(path)
    units = unit_table(model, context=DEFAULT_SESSIONS.max_context)
    kv = sum(u.kv_bytes_per_token for u in units) * DEFAULT_SESSIONS.max_context
    need = sum(u.weight_bytes for u in units) + kv * DEFAULT_SESSIONS.max_sessions
    memory = int(need / stages * 1.25) + (64 << 20)
    devices = DeviceList.from_obj(
        {
            "devices": [
                {"name": f"d{i}", "memory_bytes": memory, "gflops": 50, "bandwidth_mbps": 1000}
                for i in range(stages)
            ]
        }
    )
    with PeakMemory() as before:
        pass
    outcome = gguf_split_and_run(DeployCommand(path, "bench"), devices, work / "v1")
    card = outcome.card
    assert card is not None and card.build is not None
    built = card.build
    largest = built.largest_segment_bytes
    print(f"segments: {len(outcome.manifest.segments)}, file {card.file_bytes / MB:.1f} MB")
    print(
        f"peak resident memory while building: {built.peak_rss_bytes / MB:.1f} MB "
        f"(resident before the build: {before.bytes / MB:.1f} MB)"
    )
    print(
        f"largest segment {largest / MB:.1f} MB; peak - largest segment = "
        f"{(built.peak_rss_bytes - largest) / MB:.1f} MB (target < 300 MB); "
        f"peak / file = {built.peak_rss_bytes / card.file_bytes:.2f}; "
        f"build {built.seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
