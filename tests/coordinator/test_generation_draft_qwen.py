"""Heavy: Qwen2.5-Coder-0.5B-Instruct (int4) drafts for Qwen2.5-Coder-1.5B-Instruct (int4).

The real pair: the 0.5B export passes the tokenizer check against the 1.5B export, and greedy
chat text with the 0.5B model drafting equals plain greedy decoding of the 1.5B model token for
token, with most drafts accepted (the two models are trained alike). Needs both exports (the
``models`` extra; converted and cached on first use).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_generation_draft_model import LocalVerifier, WholeModel, _info, _model

from coordinator.generation.draft_model import DraftModel, check_draft_model
from coordinator.generation.engine import GenerationRequest, TextDelta, generate
from coordinator.generation.sampling import SamplingParams
from coordinator.generation.tokenizer import ChatTokenizer

pytestmark = [pytest.mark.heavy, pytest.mark.slow, pytest.mark.timeout(3600)]

QUESTION = "Write a Python function that returns the n-th Fibonacci number."
TOKENS = 24


def test_the_0_5b_model_drafts_for_the_1_5b_model(
    qwen_int4_dir: Path, qwen_draft_int4_dir: Path
) -> None:
    import asyncio

    assert check_draft_model(qwen_draft_int4_dir, qwen_int4_dir).num_layers == 24
    tokenizer = ChatTokenizer.from_file(qwen_int4_dir, _info(qwen_int4_dir))
    prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": QUESTION}]))
    whole = WholeModel(qwen_int4_dir)
    eos = set(_info(qwen_int4_dir).eos_token_ids)
    want = [t for t in whole.ort.greedy(prompt, TOKENS) if t not in eos]
    draft = DraftModel(qwen_draft_int4_dir, qwen_int4_dir)
    model = _model(LocalVerifier(whole), qwen_int4_dir, draft.stream)
    request = GenerationRequest(prompt, TOKENS, SamplingParams(temperature=0), session="q")

    async def text() -> str:
        out = ""
        async for event in generate(model, request):
            if isinstance(event, TextDelta):
                out += event.text
        return out

    assert asyncio.run(text()) == tokenizer.decode(want)
    assert model.speculation is not None
    rate = model.speculation.stats.acceptance_rate
    assert rate is not None and rate > 0.3, rate
