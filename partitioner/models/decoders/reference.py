"""The reference the exports are checked against: transformers' own greedy ``generate``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def transformers_greedy(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Iterable[int] = (),
) -> list[int]:
    """New token ids from ``model.generate`` (greedy, transformers' own cache and masks).

    Ends after a token in ``stop_ids``; with none, exactly ``max_new_tokens`` are generated.
    torch is imported here.
    """
    import torch

    stops = list(stop_ids)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.int64)
    options: dict[str, Any] = (
        {"eos_token_id": stops} if stops else {"min_new_tokens": max_new_tokens}
    )
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
            **options,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]
