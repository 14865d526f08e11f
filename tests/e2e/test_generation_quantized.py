"""Integration: an int4 or int8 decoder deployed by ``fedshard deploy`` to real agents generates
what the same quantized model does in one ONNX Runtime session, with and without speculation.

``tiny-llama`` is exported, stored in int4 (int8) by ONNX Runtime's quantizer
(:func:`partitioner.models.decoders.precision.quantize_decoder`) and deployed on three paired agents
under per-device caps that no single device can meet for the whole quantized model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
import pytest
from generation_lab import GenLab, decoder_lab, greedy_reference

from partitioner.models.decoders.ort_runner import read_info
from partitioner.models.decoders.precision import Weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL_ID = "tiny-llama-int4"
INT8_MODEL_ID = "tiny-llama-int8"
PROMPT = "The devices of a local network"
CAP = "6MB"
"""The int4 model (2.6 MB) with each stage's runtime memory and the 4 MiB of KV cache four
sessions reserve fits on no single device: at least two stages."""
INT8_CAP = "8MB"
"""The same for the int8 model (4.4 MB)."""


@contextmanager
def _quantized_lab(
    source: Path, factory: pytest.TempPathFactory, weights: Weights, model_id: str, cap: str
) -> Iterator[GenLab]:
    """``source`` stored in ``weights`` and deployed on three agents under ``cap`` each."""
    from partitioner.models.decoders.precision import quantize_decoder

    tmp = factory.mktemp(f"generation-{weights}")
    export = tmp / "export"
    quantize_decoder(source, export, weights)
    with decoder_lab(export, tmp, model_id, "512MiB", cap) as started:
        yield started


@pytest.fixture(scope="module")
def lab(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    with _quantized_lab(tiny_llama_dir, tmp_path_factory, "int4", MODEL_ID, CAP) as started:
        yield started


@pytest.fixture
def int8_lab(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    """The int8 model on its own agents."""
    with _quantized_lab(
        tiny_llama_dir, tmp_path_factory, "int8", INT8_MODEL_ID, INT8_CAP
    ) as started:
        yield started


def test_int4_greedy_generation_across_agents_matches_one_session(lab: GenLab) -> None:
    manifest = json.loads(next(lab.coordinator.state_dir.rglob("manifest.json")).read_text())
    assert len(manifest["segments"]) >= 2
    ops = {"MatMulNBits", "GatherBlockQuantized"}
    assert manifest["model"]["param_bytes"] < 4_000_000  # int4 bytes, not float32's 16 MB
    want, count = greedy_reference(lab.export, PROMPT, 24)
    with lab.coordinator.client() as api:
        body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        response = api.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == want
    assert response.json()["usage"]["completion_tokens"] == count
    model = onnx.load(str(lab.export / "model.onnx"), load_external_data=False)
    assert ops <= {n.op_type for n in model.graph.node}


def test_int4_speculates_and_keeps_the_greedy_text(lab: GenLab) -> None:
    """int4 graphs compute each row alike in passes of any size (on CPUs whose int4 kernel
    does; elsewhere the export marks them coupled and the chain decodes a token a pass), so
    ``auto`` speculation is in effect for them: prompt lookup drafts on a prompt that repeats
    itself, the chain verifies the drafts in passes of several positions (the random model
    rejects them, so every stage also cuts its KV cache back), and it still answers what one
    session's one-token steps answer. (The real 1.5B model accepts drafts:
    ``tests/e2e/test_generation_qwen.py``.)"""
    prompt = "one two three four five one two three four five one two three"
    want, count = greedy_reference(lab.export, prompt, 32)
    with lab.coordinator.client() as api:
        body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 32, "temperature": 0}
        response = api.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        [entry] = [m for m in api.get("/v1/console/models").json() if m["model_id"] == MODEL_ID]
    assert response.json()["choices"][0]["text"] == want
    assert response.json()["usage"]["completion_tokens"] == count
    if not read_info(lab.export / "model.onnx").rows_independent:  # AVX2: marked at export
        assert "a token a pass" in entry["speculation_off"] and entry["drafted_tokens"] == 0
        return
    assert entry["speculation_off"] is None, entry
    assert entry["drafted_tokens"] > 0, json.dumps(entry)


def test_int8_speculates_across_agents_and_keeps_the_greedy_text(int8_lab: GenLab) -> None:
    """int8 graphs quantize each row's activations alone
    (:mod:`partitioner.models.decoders.int8rows`), so a drafted token verified in a pass of several
    decodes as it does alone: ``auto`` speculation is in effect on every CPU, the chain
    verifies drafts (and cuts every stage's KV cache back where the random model rejects them)
    and answers what one session's one-token steps answer. The random model seldom repeats a
    token of its prompt, which prompt lookup needs to draft at all, so the prompt grows by the
    chain's own answers: by the third round it holds tokens the model says again."""
    lab = int8_lab
    manifest = json.loads(next(lab.coordinator.state_dir.rglob("manifest.json")).read_text())
    assert len(manifest["segments"]) >= 2
    assert read_info(lab.export / "model.onnx").rows_independent
    prompt = "one two three four five one two three four five one two three"
    for _ in range(3):
        want, count = greedy_reference(lab.export, prompt, 32)
        with lab.coordinator.client() as api:
            body = {"model": INT8_MODEL_ID, "prompt": prompt, "max_tokens": 32, "temperature": 0}
            response = api.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            models = api.get("/v1/console/models").json()
        assert response.json()["choices"][0]["text"] == want
        assert response.json()["usage"]["completion_tokens"] == count
        prompt = f"{prompt} {want}"
    [entry] = [m for m in models if m["model_id"] == INT8_MODEL_ID]
    assert entry["speculation_off"] is None, entry
    assert entry["drafted_tokens"] > 0, json.dumps(entry)
