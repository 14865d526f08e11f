"""Greedy text with speculative decoding is the text without it, for fp32, fp16, int8 and int4
exports of ``tiny-llama`` and ``tiny-gemma3`` (issue 39 item 7).

Each export runs in one ONNX Runtime session behind the generation engine
(:func:`coordinator.generation.engine.generate`): the session's keys and values are kept per
generation and cut back on a rewind, as an agent's stage keeps them. The drafter proposes the
plain run's own continuation with one token in eight wrong, so the chain verifies passes of up to
eight positions, accepts several drafts a pass and rejects some (the rejected positions are cut
back). Whether a model speculates is decided as the coordinator decides
(:func:`coordinator.serving.decoder.not_in_effect` on the export's ``decoder.json``), and a graph
whose rows are not independent (the float32 graph as exported before its products ran on at
least two rows) is probed so at export, shown and served with speculation off.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from coordinator.deploy.store import DeploymentStore, Placement, VersionRecord
from coordinator.generation.backend import GenerationModel, TopCandidates
from coordinator.generation.engine import Finished, GenerationRequest, TextDelta, generate
from coordinator.generation.sampling import SamplingParams
from coordinator.generation.speculative import Speculation, SpeculationStats, trailing_candidates
from coordinator.generation.tokenizer import ChatTokenizer
from coordinator.http.console import console_model
from coordinator.serving.decoder import DecoderModels, not_in_effect
from partitioner.models.decoders.ort_runner import read_info
from partitioner.models.decoders.precision import Weights, quantize_decoder
from partitioner.models.decoders.rowwise import (
    AT_LEAST_TWO_SUFFIX,
    probe_rows,
    without_row_padding,
)
from protocols.decoder import (
    DECODER_FILE,
    MODEL_FILE,
    TOP_IDS,
    TOP_LOGITS,
    TRAILING_TOP_IDS,
    TRAILING_TOP_LOGITS,
    DecoderInfo,
)
from protocols.plan import Objective

pytestmark = pytest.mark.timeout(900)

PRECISIONS: tuple[Weights, ...] = ("fp32", "fp16", "int8", "int4")
PROMPT = "The devices of a local network share one model, and the devices of a local network"
TOKENS = 40
PASS_S = 0.02
"""Each verifying pass also waits this long, as a chain's network hops do, so the measured
throughput makes the engine draft long (a pass's extra positions cost next to nothing)."""
_CONVERTED: dict[tuple[str, str], Path] = {}


def _export(request: pytest.FixtureRequest, name: str, weights: Weights) -> Path:
    """``name``'s session export in ``weights`` (converted once per module)."""
    source: Path = request.getfixturevalue(name.replace("-", "_") + "_dir")
    if weights == "fp32":
        return source
    if (name, weights) not in _CONVERTED:
        factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
        out = factory.mktemp(f"{name}-{weights}-speculation")
        quantize_decoder(source, out, weights)
        _CONVERTED[name, weights] = out
    return _CONVERTED[name, weights]


class OneSession:
    """A verifying decoder backend over one ONNX Runtime session: each generation's keys and
    values kept here and cut back to the position a call starts at (an agent's rewind)."""

    def __init__(self, export: Path) -> None:
        self.info = read_info(export / MODEL_FILE)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self._session = ort.InferenceSession(
            str(export / MODEL_FILE), options, providers=["CPUExecutionProvider"]
        )
        self._outputs = [o.name for o in self._session.get_outputs()]
        self._kv: dict[str, list[np.ndarray]] = {}
        self.fed: dict[str, list[int]] = {}
        """Per generation: the tokens its cache holds (the prompt and all but the last token)."""
        self.passes: list[int] = []
        """Positions of every verifying pass."""

    def _run(self, session: str, position: int, ids: Sequence[int]) -> dict[str, np.ndarray]:
        held = self.fed.get(session, [])
        assert position <= len(held), f"{session}: position {position}, held {len(held)}"
        shape = (1, self.info.num_kv_heads, 0, self.info.head_dim)
        past = self._kv.get(session) or [np.zeros(shape, np.float32) for _ in self.info.state]
        past = [
            np.take(p, range(position), axis=pair.axis)
            for p, pair in zip(past, self.info.state, strict=True)
        ]
        total = position + len(ids)
        feeds = {
            "input_ids": np.asarray([list(ids)], np.int64),
            "attention_mask": np.ones((1, total), np.int64),
            "position_ids": np.arange(position, total, dtype=np.int64)[None, :],
            **{pair.past: p for pair, p in zip(self.info.state, past, strict=True)},
        }
        values = dict(zip(self._outputs, self._session.run(self._outputs, feeds), strict=True))
        self._kv[session] = [values[pair.present] for pair in self.info.state]
        self.fed[session] = [*held[:position], *ids]
        return values

    async def step(self, session: str, position: int, token_ids: Sequence[int]) -> TopCandidates:
        values = self._run(session, position, token_ids)
        return TopCandidates.of(values[TOP_LOGITS][0], values[TOP_IDS][0])

    async def verify(
        self, session: str, position: int, token_ids: Sequence[int]
    ) -> list[TopCandidates]:
        self.passes.append(len(token_ids))
        await asyncio.sleep(PASS_S)  # a chain's pass: its time hardly grows with its positions
        values = self._run(session, position, token_ids)
        logits, ids = values[TRAILING_TOP_LOGITS], values[TRAILING_TOP_IDS]
        return trailing_candidates(logits, ids, len(token_ids))

    async def end(self, session: str) -> None:
        self._kv.pop(session, None)


class MostlyRight:
    """Drafts ``text`` (the plain run's tokens) from where the generation is, one token in
    eight replaced by another."""

    blocking = False

    def __init__(self, text: Sequence[int], vocab: int) -> None:
        self.text = list(text)
        self.vocab = vocab

    def prepare(self, tokens: Sequence[int]) -> None:
        """Nothing to read ahead."""

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        start = len(tokens)
        drafts = self.text[start : start + count]
        return [(t + 1) % self.vocab if (start + i) % 8 == 7 else t for i, t in enumerate(drafts)]


def _generate(model: GenerationModel, prompt: list[int], session: str) -> tuple[str, int]:
    async def collect() -> tuple[str, int]:
        text, count = "", -1
        request = GenerationRequest(prompt, TOKENS, SamplingParams(temperature=0), session=session)
        async for event in generate(model, request):
            if isinstance(event, TextDelta):
                text += event.text
            elif isinstance(event, Finished):
                count = event.usage.completion_tokens
        return text, count

    return asyncio.run(collect())


@pytest.mark.parametrize("weights", PRECISIONS)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_greedy_text_with_speculation_is_the_text_without(
    request: pytest.FixtureRequest, name: str, weights: Weights
) -> None:
    export = _export(request, name, weights)
    backend = OneSession(export)
    info = backend.info
    assert info.rows_probed and info == DecoderInfo.from_json((export / DECODER_FILE).read_bytes())
    tokenizer = ChatTokenizer.from_file(export, info)
    prompt = tokenizer.encode(PROMPT)
    plain = _generate(GenerationModel(backend, tokenizer, info), prompt, "plain")
    reason = not_in_effect("auto", info, no_draft=True)
    if weights != "int4":  # int4's verdict is the CPU's (AVX2 kernels couple its rows)
        assert reason is None and info.rows_independent, reason
    if reason is not None:  # served a token a pass: nothing to compare
        assert not info.rows_independent and "a token a pass" in reason
        return
    stats = SpeculationStats()
    text = backend.fed["plain"]
    drafts = Speculation(lambda: MostlyRight(text, info.vocab_size), 8, stats)
    fast = _generate(GenerationModel(backend, tokenizer, info, drafts), prompt, "fast")
    assert fast == plain
    assert backend.fed["fast"] == backend.fed["plain"]  # token for token
    assert stats.accepted > 0 and stats.accepted < stats.drafted  # drafts kept and rejected
    assert max(backend.passes) >= 3, backend.passes  # passes of several positions


def _version(model_id: str, export: Path) -> VersionRecord:
    numbers = {"param_bytes": 1, "predicted_memory_bytes": 1, "measured_memory_bytes": 1}
    times = {"predicted_compute_s": 0.0, "warmup_s": 0.0, "load_s": 0.0}
    address = {"host": "127.0.0.1", "control_port": 1, "data_port": 2, "sha256": "0" * 64}
    return VersionRecord(
        model_id=model_id,
        version=1,
        plan_version=1,
        kind="decoder",
        state="active",
        created_at=0.0,
        source=str(export / MODEL_FILE),
        objective=Objective.THROUGHPUT,
        inputs=[],
        outputs=[],
        segments=[Placement(index=0, device="a", **address, **numbers, **times)],
        health_max_abs_diff=0.0,
    )


def test_a_graph_whose_rows_are_not_independent_is_shown_and_served_without_speculation(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The float32 graph as exported before its products ran on at least two rows: its
    one-row products differ in the last bits from a pass's, the export's probe finds it and
    records it, and the coordinator neither speculates on it nor shows it as speculating
    (the setting stays ``auto``); the export as made now is probed alike and speculates."""
    raw = tmp_path / "raw"
    shutil.copytree(tiny_llama_dir, raw)
    model = onnx.load(str(raw / MODEL_FILE))
    assert any(AT_LEAST_TWO_SUFFIX in n.name for n in model.graph.node)
    onnx.save(without_row_padding(model), str(raw / MODEL_FILE))
    assert not probe_rows(raw)
    coupled = read_info(raw / MODEL_FILE)
    assert coupled.rows_probed and not coupled.rows_independent
    assert DecoderInfo.from_json((raw / DECODER_FILE).read_bytes()) == coupled

    def unused(*_: object) -> Any:
        raise AssertionError("no chain is needed to choose the speculation")

    store = DeploymentStore(tmp_path / "state")
    models = DecoderModels(store, unused, unused, unused)  # type: ignore[arg-type]
    shown: dict[str, str | None] = {}
    for model_id, export in (("coupled", raw), ("made-now", tiny_llama_dir)):
        store.activate(_version(model_id, export), str(export))
        served = models(model_id)
        assert served is not None and store.model(model_id).speculative == "auto"
        entry = console_model(store.model(model_id), None, models.speculation_off)
        assert entry.kind == "decoder" and entry.speculative == "auto"
        shown[model_id] = entry.speculation_in_effect
        assert (served.speculation is None) == (model_id == "coupled")
    assert str(shown["coupled"]).startswith("off: rows not independent"), shown
    assert shown["made-now"] == "on: prompt lookup drafts", shown
    unprobed = coupled.model_copy(update={"rows_independent": True, "rows_probed": False})
    assert "rows not checked" in str(not_in_effect("auto", unprobed, no_draft=True))
    int8 = unprobed.model_copy(update={"weights": "int8"})  # probed before it was recorded
    assert not_in_effect("auto", int8, no_draft=True) is None
