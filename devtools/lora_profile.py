"""Profile one device's LoRA round (the agents' real ``ShardClient.fit``) with cProfile.

    python -m devtools.lora_profile EXPORT_DIR WORK_DIR [--threads 1] [--per-device 100]

``EXPORT_DIR`` is a ``fedshard export tiny-llama`` directory; the version is split as
:mod:`devtools.lora_lab` does, layers 2.. are adapted (rank 4) under Opacus DP-SGD. Prints the
round's seconds, its metrics and the 25 most expensive calls (cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from devtools.lora_lab import lora_setup, plan_config, split_version
from devtools.wordnet import write_shares


def main(argv: list[str] | None = None) -> int:
    """Run one profiled round; the exit code."""
    parser = argparse.ArgumentParser(prog="python -m devtools.lora_profile")
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("work_dir", type=Path)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--per-device", type=int, default=100)
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from edge_agent.training.client_app import ShardClient
    from edge_agent.training.local import LocalSettings
    from partitioner.models.decoders import tiny
    from protocols.lora import RecordDp

    version = args.work_dir / "v0001"
    if not version.is_dir():
        split_version(args.export_dir, version)
    model, _ = tiny.llama()
    setup = lora_setup(
        args.export_dir, version, model, 2, dp=RecordDp(), run=f"profile-{time.time_ns()}",
        max_tokens=24, batch_size=16, learning_rate=0.02, local_epochs=2,
    )  # fmt: skip
    [data] = write_shares(args.work_dir / "data", (("noun.animal",),), args.per_device)
    client = ShardClient(LocalSettings(version, data, args.work_dir / "cache", 1 << 30), 0)
    profile = cProfile.Profile()
    start = time.monotonic()
    profile.enable()
    _, _, metrics = client.fit(setup.initial, plan_config(setup.plan, 1))
    profile.disable()
    print(f"round: {time.monotonic() - start:.1f} s with {torch.get_num_threads()} thread(s)")
    print(metrics)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
