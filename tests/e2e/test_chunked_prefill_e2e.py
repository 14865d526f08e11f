"""Integration: a prompt longer than a decoder's planned step is prefilled in chunks.

``tiny-llama`` on three real agents (the generation lab). Its deployment carries the planned
shapes as limits (at most 64 new tokens a step, the planned context); a 200-token prompt is
sent as four session steps that each fit, and the greedy continuation equals the whole model's
run in one ONNX Runtime session with the prompt prefilled at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from generation_lab import decoder_lab

from coordinator.deploy.limits import PREFILL_CHUNK
from devtools.reference import greedy_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL_ID = "tiny-llama-chunked"
PROMPT = " ".join(f"item {i} of the list," for i in range(40))


def test_a_long_prompt_is_prefilled_in_planned_chunks_with_the_same_text(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    prompt_tokens = len(Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")).encode(PROMPT))
    assert prompt_tokens > 3 * PREFILL_CHUNK
    want, count = greedy_reference(tiny_llama_dir, PROMPT, 12)
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    with (
        decoder_lab(tiny_llama_dir, tmp_path, MODEL_ID, "512MiB", "12MB") as lab,
        lab.coordinator.client() as api,
    ):
        [record] = [m for m in api.get("/v1/deployments").json() if m["model_id"] == MODEL_ID]
        response = api.post("/v1/completions", json=body)
    [live] = [v for v in record["versions"] if v["state"] == "active"]
    assert live["limits"]["dims"]["sequence"] == PREFILL_CHUNK, live["limits"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == want
    assert response.json()["usage"]["completion_tokens"] == count
    assert response.json()["usage"]["prompt_tokens"] > 3 * PREFILL_CHUNK
