"""Decoder front doors: ``fedshard export tiny-llama | tiny-gemma3 | gemma3-270m OUT_DIR``.

The exported graph follows :mod:`protocols.decoder`; ONNX Runtime greedy decoding in one session
must reproduce transformers' own greedy ``generate`` token for token.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from partitioner.analysis.samples import embedded_samples
from partitioner.cutting.verify import run_model
from partitioner.models.decoders.ort_runner import OrtDecoder, read_info
from protocols.decoder import (
    DECODER_FILE,
    MODEL_FILE,
    TRAILING_POSITIONS,
    DecoderInfo,
    past_name,
    present_name,
)

pytestmark = pytest.mark.slow

PROMPT = "The devices of the lab passed the hidden state along and"


def _prompt_ids(tokenizer: Any) -> list[int]:
    return [int(i) for i in tokenizer(PROMPT)["input_ids"]]


def _fresh(name: str) -> tuple[Any, Any]:
    from partitioner.models.decoders import tiny

    return tiny.llama() if name == "tiny-llama" else tiny.gemma3()


@pytest.fixture(params=["tiny-llama", "tiny-gemma3"])
def tiny(request: pytest.FixtureRequest) -> tuple[str, Path]:
    fixture = "tiny_llama_dir" if request.param == "tiny-llama" else "tiny_gemma3_dir"
    return request.param, request.getfixturevalue(fixture)


def test_ort_greedy_matches_transformers_generate(tiny: tuple[str, Path]) -> None:
    from partitioner.models.decoders.reference import transformers_greedy

    name, directory = tiny
    model, tokenizer = _fresh(name)
    prompt = _prompt_ids(tokenizer)
    decoder = OrtDecoder(directory, threads=1)
    got = decoder.greedy(prompt, 32, stop_ids=())
    want = transformers_greedy(model, prompt, 32)
    assert len(want) == 32
    assert got == want
    if decoder.info.sliding_window is not None:  # generation ran well past the window
        assert decoder.context_length == len(prompt) + 31 > 3 * decoder.info.sliding_window


def test_sliding_window_is_honoured(tiny_gemma3_dir: Path) -> None:
    """The last position's logits equal transformers' (sliding window on) and differ from the
    same weights with the window opened to the whole context."""
    import torch

    model, tokenizer = _fresh("tiny-gemma3")
    ids = (_prompt_ids(tokenizer) * 3)[:30]
    result = OrtDecoder(tiny_gemma3_dir).prefill(ids)
    with torch.no_grad():
        windowed = model(torch.tensor([ids])).logits[0, -1].numpy()
        model.config.sliding_window = 10_000
        unwindowed = model(torch.tensor([ids])).logits[0, -1].numpy()
    np.testing.assert_allclose(result.top_logits, windowed[result.top_ids], atol=1e-4)
    assert int(np.argmax(windowed)) == result.token
    assert np.abs(unwindowed[result.top_ids] - result.top_logits).max() > 1e-2


def test_decoder_json_round_trips_and_names_the_graph(tiny: tuple[str, Path]) -> None:
    name, directory = tiny
    text = (directory / DECODER_FILE).read_text()
    info = DecoderInfo.from_json(text)
    assert DecoderInfo.from_json(info.to_json()) == info
    assert read_info(directory / MODEL_FILE) == info
    assert info.model == name and info.top_k == 64
    assert info.sliding_window == (8 if name == "tiny-gemma3" else None)
    model = onnx.load(str(directory / MODEL_FILE), load_external_data=False)
    layers = range(info.num_layers)
    kinds = ("key", "value")
    assert [i.name for i in model.graph.input] == [
        "input_ids",
        "attention_mask",
        "position_ids",
        *(past_name(i, k) for i in layers for k in kinds),
    ]
    assert [o.name for o in model.graph.output] == [
        "top_logits",
        "top_ids",
        "trailing_top_logits",
        "trailing_top_ids",
        *(present_name(i, k) for i in layers for k in kinds),
    ]
    assert info.trailing_positions == TRAILING_POSITIONS
    assert [(p.past, p.present) for p in info.state] == [
        (past_name(i, k), present_name(i, k)) for i in layers for k in kinds
    ]
    assert (directory / "tokenizer.json").is_file()


@pytest.mark.parametrize("q", [1, 3])
def test_present_is_past_grown_by_q(tiny_gemma3_dir: Path, q: int) -> None:
    info = read_info(tiny_gemma3_dir / MODEL_FILE)
    rng = np.random.default_rng(q)
    past = {
        p.past: rng.standard_normal((1, info.num_kv_heads, 5, info.head_dim)).astype(np.float32)
        for p in info.state
    }
    feeds = {
        "input_ids": rng.integers(1000, 2000, size=(1, q)),
        "attention_mask": np.ones((1, 5 + q), dtype=np.int64),
        "position_ids": np.arange(5, 5 + q, dtype=np.int64)[None, :],
        **past,
    }
    out = run_model(tiny_gemma3_dir / MODEL_FILE, feeds)
    assert out["top_ids"].shape == out["top_logits"].shape == (1, info.top_k)
    assert np.all(np.diff(out["top_logits"][0]) <= 0)
    for pair in info.state:
        present = out[pair.present]
        assert present.shape == (1, info.num_kv_heads, 5 + q, info.head_dim)
        np.testing.assert_array_equal(present[:, :, :5], past[pair.past])


@pytest.mark.parametrize("q", [1, 4, TRAILING_POSITIONS + 3])
def test_trailing_top_k_matches_one_token_steps(tiny_gemma3_dir: Path, q: int) -> None:
    """One pass over q tokens returns, for each of its last min(q, W) positions, the top-k a
    token-by-token run gives there (what verifying drafted tokens relies on)."""
    decoder = OrtDecoder(tiny_gemma3_dir)
    ids = [int(i) for i in np.random.default_rng(q).integers(1000, 2000, size=12 + q)]
    decoder.prefill(ids[:12])
    out = run_model(
        tiny_gemma3_dir / MODEL_FILE,
        {
            "input_ids": np.asarray([ids[12:]], dtype=np.int64),
            "attention_mask": np.ones((1, 12 + q), dtype=np.int64),
            "position_ids": np.arange(12, 12 + q, dtype=np.int64)[None, :],
            **decoder.kv,
        },
    )
    kept = min(q, TRAILING_POSITIONS)
    assert out["trailing_top_ids"].shape == (1, kept, decoder.info.top_k)
    np.testing.assert_array_equal(out["trailing_top_ids"][:, -1], out["top_ids"])
    steps = [decoder.decode(token) for token in ids[12:]]
    for row, step in enumerate(steps[q - kept :]):
        assert out["trailing_top_ids"][0, row, 0] == step.top_ids[0]
        np.testing.assert_allclose(out["trailing_top_logits"][0, row], step.top_logits, atol=1e-4)


def test_graph_never_reads_the_shape_of_a_past_tensor(tiny: tuple[str, Path]) -> None:
    """A stage holding layers k.. has only their past: each ``past.{i}.*`` may feed nothing
    but the Concat making ``present.{i}.*``, no Shape/Size may read a key/value tensor (masks
    and positions come from attention_mask and position_ids), and no layer's present may
    depend on a later layer's past."""
    _, directory = tiny
    model = onnx.load(str(directory / MODEL_FILE), load_external_data=False)
    info = read_info(directory / MODEL_FILE)
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    producer: dict[str, onnx.NodeProto] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers[name].append(node)
        for name in node.output:
            producer[name] = node
    kv = {p.past for p in info.state} | {p.present for p in info.state}
    for pair in info.state:
        users = consumers[pair.past]
        assert [(n.op_type, list(n.output)) for n in users] == [("Concat", [pair.present])]
    shape_readers = [
        n.name for n in model.graph.node if n.op_type in ("Shape", "Size") and n.input[0] in kv
    ]
    assert shape_readers == []
    for layer in range(info.num_layers):
        seen = _graph_inputs_upstream(present_name(layer, "key"), producer)
        later = {
            past_name(j, k) for j in range(layer + 1, info.num_layers) for k in ("key", "value")
        }
        assert not seen & later
        # rotary positions reach every key; the mask reaches later layers through attention
        assert {"position_ids", past_name(layer, "key")} <= seen
        assert ("attention_mask" in seen) == (layer > 0)


def _graph_inputs_upstream(tensor: str, producer: dict[str, onnx.NodeProto]) -> set[str]:
    seen: set[str] = set()
    stack = [tensor]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None:
            stack.extend(i for i in node.input if i)
    return seen


def test_embedded_samples_are_a_one_token_step_after_a_real_prompt(tiny_llama_dir: Path) -> None:
    from partitioner.models.decoders.export import SAMPLE_PAST, SAMPLE_TEXT
    from partitioner.models.decoders.tiny import tokenizer

    path = tiny_llama_dir / MODEL_FILE
    samples = embedded_samples(onnx.load(str(path), load_external_data=False))
    assert samples is not None
    info = read_info(path)
    assert samples["input_ids"].shape == (1, 1)
    np.testing.assert_array_equal(samples["position_ids"], [[SAMPLE_PAST]])
    assert samples["attention_mask"].shape == (1, SAMPLE_PAST + 1)
    assert all(samples[p.past].shape[2] == SAMPLE_PAST for p in info.state)
    # the past is the real prefill of the sample text's first tokens: replay it in one session
    decoder = OrtDecoder(tiny_llama_dir)
    decoder.prefill(tokenizer()(SAMPLE_TEXT)["input_ids"][:SAMPLE_PAST])
    for pair in info.state:
        np.testing.assert_allclose(decoder.kv[pair.past], samples[pair.past], atol=1e-5)
    replay = decoder.decode(int(samples["input_ids"][0, 0]))
    out = run_model(path, samples)
    np.testing.assert_allclose(replay.top_logits, out["top_logits"][0], atol=1e-5)


def test_cli_passes_top_k_and_the_cache_dir_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from partitioner.cli import split_cli
    from partitioner.models import frontdoor
    from partitioner.models.frontdoor import ExportResult

    calls: list[dict[str, Any]] = []

    def fake(out: Path, **options: Any) -> ExportResult:
        calls.append({"out": out, **options})
        return ExportResult(out / MODEL_FILE, ("top_logits", "top_ids"), 0.0, 10)

    monkeypatch.setitem(frontdoor.FRONT_DOORS, "tiny-llama", fake)
    monkeypatch.setenv("FEDSHARD_CACHE", str(tmp_path / "env-cache"))
    parser = argparse.ArgumentParser()
    split_cli.register(parser.add_subparsers())
    args = parser.parse_args(["export", "tiny-llama", str(tmp_path / "out"), "--top-k", "8"])
    assert args.run(args) == 0
    args = parser.parse_args(
        ["export", "tiny-llama", str(tmp_path / "o2"), "--cache-dir", str(tmp_path / "c")]
    )
    assert args.run(args) == 0
    assert [(c["out"].name, c["top_k"], c["cache_dir"]) for c in calls] == [
        ("out", 8, tmp_path / "env-cache"),
        ("o2", 64, tmp_path / "c"),
    ]
    assert all("draft_vocabulary" not in c for c in calls)
    for extra, vocabulary in (["--draft"], 32768), (["--draft", "1000"], 1000):
        args = parser.parse_args(["export", "tiny-llama", str(tmp_path / "d"), *extra])
        assert args.run(args) == 0
        assert calls[-1]["draft_vocabulary"] == vocabulary


@pytest.fixture(scope="module")
def gemma_source(repo_cache: Path) -> Any:
    from partitioner.models.decoders.progress import Steps
    from partitioner.models.decoders.sources import load_source

    return load_source("gemma3-270m", repo_cache, Steps())


def test_real_gemma_greedy_matches_transformers_on_a_chat_prompt(
    gemma_export_dir: Path, gemma_source: Any
) -> None:
    from partitioner.models.decoders.reference import transformers_greedy

    source = gemma_source
    chat = [{"role": "user", "content": "Name three colours of the rainbow."}]
    encoded = source.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    prompt = [int(i) for i in encoded["input_ids"]]
    decoder = OrtDecoder(gemma_export_dir)
    assert decoder.info.num_layers == 18 and decoder.info.sliding_window == 512
    got = decoder.greedy(prompt, 32)
    want = transformers_greedy(source.model, prompt, 32, stop_ids=decoder.info.eos_token_ids)
    assert got == want
    assert len(got) == 32  # the base (not instruction-tuned) model does not end its turn
    # plain completion is coherent English (the package holds the pretrained base model)
    plain = [int(i) for i in source.tokenizer("The capital of France is")["input_ids"]]
    text = source.tokenizer.decode(decoder.greedy(plain, 12), skip_special_tokens=True)
    assert text.split()[:2] == ["the", "capital"] and "France" in text


def test_real_gemma_keeps_its_512_token_sliding_window(
    gemma_export_dir: Path, gemma_source: Any
) -> None:
    """Past 512 tokens the local layers must stop seeing the start (masking, not truncation)."""
    import torch

    model, tokenizer = gemma_source.model, gemma_source.tokenizer
    text = " ".join(f"Item {n} is stored on device {n % 7}." for n in range(80))
    ids = [int(i) for i in tokenizer(text)["input_ids"]][:600]
    assert len(ids) == 600
    result = OrtDecoder(gemma_export_dir).prefill(ids)
    with torch.no_grad():
        windowed = model(torch.tensor([ids])).logits[0, -1].numpy()
        model.config.sliding_window = 4096
        try:
            unwindowed = model(torch.tensor([ids])).logits[0, -1].numpy()
        finally:
            model.config.sliding_window = 512
    np.testing.assert_allclose(result.top_logits[:8], windowed[result.top_ids[:8]], atol=2e-3)
    assert int(np.argmax(windowed)) == result.token
    assert np.abs(unwindowed[result.top_ids] - result.top_logits).max() > 1e-2
