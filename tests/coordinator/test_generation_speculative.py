"""Speculative decoding units: prompt lookup, draft length, acceptance, the engine's passes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from generation_helpers import BigramBackend, bigram_table, tiny_model, word_id

from coordinator.deploy.store import VersionRecord
from coordinator.errors import ChainBrokenError
from coordinator.generation.backend import TopCandidates
from coordinator.generation.drafters import LookupThenModel, PromptLookup
from coordinator.generation.engine import Finished, GenerationRequest, TextDelta, generate
from coordinator.generation.sampling import SamplingParams, nucleus, probabilities
from coordinator.generation.speculative import (
    Speculation,
    SpeculationStats,
    Speculative,
    accept,
    trailing_candidates,
)
from coordinator.serving.decoder import ChainDecoderBackend
from coordinator.transport.dataplane import DataPlane, SessionStep
from protocols.decoder import (
    INPUT_IDS,
    TOP_IDS,
    TOP_LOGITS,
    TRAILING_POSITIONS,
    TRAILING_TOP_IDS,
    TRAILING_TOP_LOGITS,
)

CHAIN = [" the", " cat", " sat", " on", " the", " mat", " a", " big", " red", " dog", " ran"]


class VerifyingBigram(BigramBackend):
    """The bigram fake with one-pass verification: every fed token's candidates, and a
    session that may be cut back to any position it holds (never past it)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.passes: list[tuple[int, list[int]]] = []
        self.rewinds = 0

    async def verify(
        self, session: str, position: int, token_ids: Sequence[int]
    ) -> list[TopCandidates]:
        held = self.lengths.get(session, 0)
        if position > held:
            raise AssertionError(f"{session}: rewind to {position}, held {held}")
        self.passes.append((position, list(token_ids)))
        self.rewinds += position < held
        self.lengths[session] = position + len(token_ids)
        await asyncio.sleep(0)
        return [self.candidates(int(t)) for t in token_ids]


def test_prompt_lookup_continues_the_most_recent_longest_match() -> None:
    lookup = PromptLookup(max_ngram=3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert lookup.propose(tokens, 3) == [4, 5, 6]  # the later copy of 1 2 3
    assert lookup.propose(tokens, 0) == []
    assert lookup.propose([5, 6, 7, 8], 4) == []  # nothing repeats
    assert lookup.propose([1, 2, 8, 2], 2) == [8, 2]  # falls back to a 1-gram
    assert lookup.propose([1, 2, 3, 1, 2], 9) == [3, 1, 2]  # stops at the end of the text


class FixedDrafter:
    """A drafter that always proposes the same tokens (records its calls)."""

    blocking = True

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.calls = 0

        self.prepared: list[list[int]] = []

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        self.calls += 1
        return self.tokens[:count]

    def prepare(self, tokens: Sequence[int]) -> None:
        self.prepared.append(list(tokens))


def test_lookup_then_model_drafts_by_lookup_on_a_repeated_bigram_else_by_model() -> None:
    model = FixedDrafter([42, 43])
    drafter = LookupThenModel(model)
    assert drafter.propose([1, 2, 3, 9, 1, 2], 2) == [3, 9]  # "1 2" occurred before
    assert model.calls == 0
    assert drafter.propose([1, 2, 3, 9, 5, 2], 2) == [42, 43]  # only a 1-gram repeats
    assert model.calls == 1
    drafter.prepare([7, 8])
    assert model.prepared == [[7, 8]]  # the model reads the prompt ahead


def test_greedy_acceptance_keeps_the_agreeing_prefix_then_the_model_s_token() -> None:
    cands = [TopCandidates.of([9.0, 1.0], [t, 0]) for t in (5, 6, 7, 8)]
    params, rng = SamplingParams(temperature=0), np.random.default_rng(0)
    assert accept([5, 6, 7], cands, params, rng) == [5, 6, 7, 8]  # all kept, plus one
    assert accept([5, 4, 7], cands, params, rng) == [5, 6]  # the model's token replaces 4
    assert accept([], cands[:1], params, rng) == [5]
    with pytest.raises(ValueError, match="candidate sets"):
        accept([5], cands, params, rng)


def test_sampled_acceptance_keeps_the_target_distribution() -> None:
    """First token of a pass with draft ``d``: accepted with p(d), else drawn from p without
    d, so over many passes it is distributed as p (here after temperature and top-p)."""
    cands = TopCandidates.of([2.0, 1.5, 1.0, 0.2, -1.0], [10, 11, 12, 13, 14])
    params = SamplingParams(temperature=0.8, top_p=0.9)
    want = nucleus(probabilities(cands.logits, 0.8), 0.9)
    rng = np.random.default_rng(7)
    draws = 20_000
    for draft in (11, 14):  # a likely draft, and one top-p has cut
        counts = dict.fromkeys(cands.ids.tolist(), 0)
        for _ in range(draws):
            counts[accept([draft], [cands, cands], params, rng)[0]] += 1
        got = np.array([counts[i] for i in cands.ids.tolist()]) / draws
        np.testing.assert_allclose(got, want, atol=0.015)


def test_trailing_candidates_take_the_last_rows() -> None:
    logits = np.arange(24, dtype=np.float32).reshape(1, 4, 6)[:, :, ::-1].copy()
    ids = np.arange(24).reshape(1, 4, 6)
    got = trailing_candidates(logits, ids, 2)
    assert [c.ids[0] for c in got] == [12, 18]
    with pytest.raises(ValueError, match="cannot give 5"):
        trailing_candidates(logits, ids, 5)


def _run(model: object, request: GenerationRequest) -> tuple[str, Finished]:
    async def collect() -> tuple[str, Finished]:
        text, finished = "", None
        async for event in generate(model, request):  # type: ignore[arg-type]
            if isinstance(event, TextDelta):
                text += event.text
            elif isinstance(event, Finished):
                finished = event
        assert finished is not None
        return text, finished

    return asyncio.run(collect())


@pytest.mark.parametrize("max_tokens", [1, 5, 40])
def test_greedy_text_is_the_same_with_and_without_speculation(max_tokens: int) -> None:
    table = bigram_table(seed=3, chain=CHAIN)
    prompt = [word_id(w) for w in CHAIN[:6]] * 2  # the text repeats what it will generate
    request = GenerationRequest(prompt, max_tokens, SamplingParams(temperature=0), session="s")
    plain = _run(tiny_model(BigramBackend(table)), request)
    backend = VerifyingBigram(table)
    stats = SpeculationStats()
    model = tiny_model(backend)
    fast = _run(
        type(model)(
            model.backend, model.tokenizer, model.info, Speculation(PromptLookup, 8, stats)
        ),
        request,
    )
    assert fast == plain
    assert fast[1].usage.completion_tokens == max_tokens
    assert backend.ended == ["s"]
    # never past the context plain decoding uses: the last token is never fed
    assert all(p + len(t) <= len(prompt) + max_tokens - 1 for p, t in backend.passes)
    if max_tokens == 40:
        assert stats.accepted > 0 and len(backend.passes) < max_tokens - 1
        assert backend.rewinds > 0  # some drafts were rejected and cut back


def test_the_drafter_reads_the_prompt_while_the_chain_prefills() -> None:
    table = bigram_table(seed=3, chain=CHAIN)
    prompt = [word_id(w) for w in CHAIN[:6]]
    drafter = FixedDrafter([word_id(CHAIN[6])])
    model = tiny_model(VerifyingBigram(table))
    request = GenerationRequest(prompt, 6, SamplingParams(temperature=0), session="s")
    stats = SpeculationStats()
    speculating = type(model)(
        model.backend, model.tokenizer, model.info, Speculation(lambda: drafter, 8, stats)
    )
    assert _run(speculating, request) == _run(tiny_model(BigramBackend(table)), request)
    assert drafter.prepared == [prompt]  # once, the prompt alone, before any draft
    assert drafter.calls > 0 and stats.drafted > 0


class BrokenPrefill(VerifyingBigram):
    """A chain that loses a stage while reading the prompt."""

    async def step(self, session: str, position: int, token_ids: Sequence[int]) -> TopCandidates:
        raise ChainBrokenError("LinkError: stage 1 went away")


class UnreadyDrafter(FixedDrafter):
    """A drafter that cannot read the prompt ahead (it catches up when it drafts)."""

    def prepare(self, tokens: Sequence[int]) -> None:
        raise RuntimeError("the draft model's session failed")


def test_a_failed_prefill_raises_its_own_error_while_the_drafter_reads_ahead() -> None:
    table = bigram_table(seed=3, chain=CHAIN)
    prompt = [word_id(w) for w in CHAIN[:6]]
    request = GenerationRequest(prompt, 4, SamplingParams(temperature=0), session="s")
    model = tiny_model(BrokenPrefill(table))
    drafter = FixedDrafter([1])
    speculating = type(model)(
        model.backend, model.tokenizer, model.info,
        Speculation(lambda: drafter, 8, SpeculationStats()),
    )  # fmt: skip
    with pytest.raises(ChainBrokenError, match="stage 1"):  # not wrapped in a group
        _run(speculating, request)
    assert drafter.prepared == [prompt]


def test_a_drafter_that_cannot_read_ahead_leaves_the_text_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = bigram_table(seed=3, chain=CHAIN)
    prompt = [word_id(w) for w in CHAIN[:6]]
    request = GenerationRequest(prompt, 6, SamplingParams(temperature=0), session="s")
    model = tiny_model(VerifyingBigram(table))
    drafter = UnreadyDrafter([word_id(CHAIN[6])])
    speculating = type(model)(
        model.backend, model.tokenizer, model.info,
        Speculation(lambda: drafter, 8, SpeculationStats()),
    )  # fmt: skip
    assert _run(speculating, request) == _run(tiny_model(BigramBackend(table)), request)
    assert "could not read the prompt ahead" in caplog.text
    assert drafter.calls > 0


class LosingChain:
    """A fake chain client: stages that keep per-session lengths (rewind included, as agents
    do) and answer from a bigram table; the first pass that carries drafts loses a stage."""

    def __init__(self, table: np.ndarray) -> None:
        self.bigram = BigramBackend(table)
        self.held: dict[str, int] = {}
        self.calls: list[tuple[str, int, int, bool]] = []
        self.lost = False

    async def infer_async(
        self, tensors: dict[str, np.ndarray], timeout: float, session: SessionStep
    ) -> dict[str, np.ndarray]:
        if session.end:
            self.held.pop(session.session_id, None)
            return {}
        ids = [int(t) for t in tensors[INPUT_IDS][0]]
        self.calls.append((session.session_id, session.position, len(ids), session.rewind))
        held = self.held.get(session.session_id)
        if held is None and session.position != 0:
            raise ChainBrokenError("SessionStateError: unknown session")
        if session.rewind and session.position > (held or 0):
            raise ChainBrokenError("SessionRewindError: never held that many")
        if not session.rewind and session.position != (held or 0):
            raise ChainBrokenError("SessionStateError: wrong position")
        if len(ids) > 1 and session.position > 0 and not self.lost:
            self.lost = True
            self.held.clear()  # the stage with every session's cache is gone
            raise ChainBrokenError("LinkError: stage 2 went away")
        self.held[session.session_id] = session.position + len(ids)
        tail = [self.bigram.candidates(t) for t in ids[-TRAILING_POSITIONS:]]
        return {
            TOP_LOGITS: tail[-1].logits[None],
            TOP_IDS: tail[-1].ids[None],
            TRAILING_TOP_LOGITS: np.stack([c.logits for c in tail])[None],
            TRAILING_TOP_IDS: np.stack([c.ids for c in tail])[None],
        }


def test_a_stage_lost_mid_speculation_replays_to_the_same_text() -> None:
    table = bigram_table(seed=3, chain=CHAIN)
    prompt = [word_id(w) for w in CHAIN[:6]] * 2
    request = GenerationRequest(prompt, 30, SamplingParams(temperature=0), session="s")
    want = _run(tiny_model(BigramBackend(table)), request)
    chain = LosingChain(table)
    versions = iter(range(1, 100))
    version = [VersionRecord.model_construct(model_id="m", plan_version=next(versions))]
    failures: list[str] = []

    def failed(record: VersionRecord, error: Exception) -> None:
        failures.append(str(error))
        version[0] = VersionRecord.model_construct(model_id="m", plan_version=next(versions))

    plane = DataPlane()
    try:
        backend = ChainDecoderBackend(plane, lambda _: (version[0], chain), failed)  # type: ignore[arg-type,return-value]
        model = tiny_model(BigramBackend(table))
        speculating = type(model)(
            backend, model.tokenizer, model.info, Speculation(PromptLookup, 8, SpeculationStats())
        )
        got = _run(speculating, request)
    finally:
        plane.close()
    assert got == want
    assert chain.lost and failures == ["LinkError: stage 2 went away"]
    replays = [c for c in chain.calls if "~" in c[0]]
    assert replays and replays[0][1] == 0 and replays[0][2] > len(prompt)  # history, re-prefilled
    assert chain.held == {}  # the session was ended on the new chain


@pytest.mark.parametrize("mode", ["auto", "lookup"])
def test_a_graph_whose_rows_are_coupled_is_never_speculated(
    mode: Speculative, tmp_path: Path
) -> None:
    """A graph marked ``rows_independent: false`` (int4 exported on an AVX2 CPU): verifying k
    tokens in one pass would not decode as k passes do, so the coordinator decodes it one token
    a pass whatever the setting says."""
    from generation_helpers import decoder_info

    from coordinator.deploy.store import DeploymentStore, ModelRecord
    from coordinator.serving.decoder import DecoderModels, not_in_effect

    def unused(*_: object) -> Any:
        raise AssertionError("no chain is needed to choose the speculation")

    models = DecoderModels(DeploymentStore(tmp_path), unused, unused, unused)
    record = ModelRecord(model_id="m", speculative=mode)
    info = decoder_info().model_copy(update={"trailing_positions": 4})
    assert models._speculation("m", record, info, rows_exact=True) is not None
    coupled = info.model_copy(update={"rows_independent": False})
    assert models._speculation("m", record, coupled, rows_exact=True) is None
    assert not_in_effect(mode, info, no_draft=False) is None
    assert "a token a pass" in str(not_in_effect(mode, coupled, no_draft=False))


def test_an_int4_decoder_speculates_only_on_devices_whose_rows_are_exact(tmp_path: Path) -> None:
    """An int4 graph computes a row alike alone and in a pass only where the CPU's 4-bit kernel
    does (AVX-512, not AVX2): one device of its chain announcing otherwise, or announcing
    nothing, turns its speculation off; float graphs are not affected."""
    from generation_helpers import decoder_info

    from coordinator.deploy.store import DeploymentStore, ModelRecord
    from coordinator.fleet.registry import DeviceRegistry
    from coordinator.serving.decoder import DecoderModels, not_in_effect, rows_exact_on
    from protocols.profile import Announcement, DeviceProfile

    def unused(*_: object) -> Any:
        raise AssertionError("no chain is needed to choose the speculation")

    info = decoder_info().model_copy(update={"trailing_positions": 4})
    int4 = info.model_copy(update={"weights": "int4"})
    record = ModelRecord(model_id="m", speculative="auto")
    models = DecoderModels(DeploymentStore(tmp_path), unused, unused, unused)
    assert models._speculation("m", record, int4, rows_exact=True) is not None
    assert models._speculation("m", record, int4, rows_exact=False) is None
    assert models._speculation("m", record, info, rows_exact=False) is not None  # float32
    assert "4-bit" in str(not_in_effect("auto", int4, False, rows_exact=False))

    registry = DeviceRegistry()
    for i, exact in enumerate((True, False, None)):
        profile = DeviceProfile(
            device_id=f"{i:016x}", name=f"d{i}", memory_bytes=1 << 30, gflops=10.0,
            control_port=9000, data_port=9001, cert_fingerprint=f"{i}" * 64,
            int4_rows_exact=exact,
        )  # fmt: skip
        registry.announce(Announcement(profile=profile), "127.0.0.1", f"d{i}._fedshard")

    def on(*devices: str) -> bool:
        version = _version(devices)
        return rows_exact_on(registry)(version)

    assert on("d0") and on("d0", "d0")
    assert not on("d0", "d1")  # an AVX2 device in the chain
    assert not on("d0", "d2")  # an agent that does not say
    assert not on("d0", "gone")  # a device the registry does not know


def _version(devices: tuple[str, ...]) -> Any:
    from coordinator.deploy.store import Placement, VersionRecord

    numbers = {"param_bytes": 1, "predicted_memory_bytes": 1, "measured_memory_bytes": 1}
    times = {"predicted_compute_s": 0.0, "warmup_s": 0.0, "load_s": 0.0}
    address = {"host": "127.0.0.1", "control_port": 1, "data_port": 2, "sha256": "0" * 64}
    placements = [
        Placement(index=i, device=name, **address, **numbers, **times)
        for i, name in enumerate(devices)
    ]
    return VersionRecord.model_construct(model_id="m", plan_version=1, segments=placements)


def test_the_console_is_told_why_a_setting_is_not_in_effect() -> None:
    from generation_helpers import decoder_info

    from coordinator.serving.decoder import not_in_effect

    info = decoder_info().model_copy(update={"trailing_positions": 4})
    assert not_in_effect("off", info.model_copy(update={"rows_independent": False}), True) is None
    assert not_in_effect("auto", info, no_draft=True) is None  # prompt lookup needs no draft
    assert not_in_effect("draft", info, no_draft=True) == "its draft model could not be loaded"
    one = info.model_copy(update={"trailing_positions": 1})
    assert "one position a pass" in str(not_in_effect("lookup", one, False))
