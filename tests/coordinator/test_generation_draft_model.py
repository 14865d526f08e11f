"""The draft-model drafter on tiny decoders (real exports, real ONNX Runtime).

The target is ``tiny-llama``, verified by a local stand-in for the chain that prefills the
whole held text in one ONNX Runtime session each pass (so its answers cannot depend on a cache
the drafter got wrong). Drafts come from ``tiny-llama`` itself (it must accept about
everything) and from ``tiny-gemma3`` (another random model with the same tokenizer: most drafts
are rejected, so the draft cache rolls back often). Greedy text equals plain greedy decoding
token for token, including when a stage is lost mid-speculation; the draft cache after a
rollback equals a fresh one; a draft with another tokenizer is refused.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest

from coordinator.deploy.store import DeploymentStore, ModelRecord, VersionRecord
from coordinator.errors import ChainBrokenError, DraftModelError
from coordinator.generation.backend import GenerationModel, TopCandidates
from coordinator.generation.draft_model import (
    DraftModel,
    DraftStream,
    check_draft_model,
    top_probability,
)
from coordinator.generation.drafters import Drafter
from coordinator.generation.engine import Finished, GenerationRequest, TextDelta, generate
from coordinator.generation.sampling import SamplingParams
from coordinator.generation.speculative import (
    Speculation,
    SpeculationStats,
    drafter_for,
    trailing_candidates,
)
from coordinator.generation.tokenizer import ChatTokenizer
from coordinator.generation.tuning import Costs, Throughput
from coordinator.http.errors import entry_of
from coordinator.serving.decoder import ChainDecoderBackend
from coordinator.transport.dataplane import DataPlane, SessionStep
from partitioner.models.decoders.ort_runner import OrtDecoder
from partitioner.models.decoders.precision import SCHEME_METADATA_KEY
from protocols.decoder import (
    INPUT_IDS,
    TOP_IDS,
    TOP_LOGITS,
    TRAILING_TOP_IDS,
    TRAILING_TOP_LOGITS,
    DecoderInfo,
)

PROMPT = "def add(a, b):\n    return a + b\n\n# now subtract\ndef"
TOKENS = 24


class WholeModel:
    """Answers a session's passes by prefilling its whole held text (no cache to get wrong)."""

    def __init__(self, export: Path) -> None:
        self.ort = OrtDecoder(export, threads=1)
        self.held: dict[str, list[int]] = {}

    def run(self, tokens: Sequence[int]) -> dict[str, np.ndarray]:
        """Every output of the graph for ``tokens`` from an empty cache."""
        self.ort.reset()
        return self.ort.run_step(tokens)

    def feed(self, session: str, position: int, ids: Sequence[int]) -> dict[str, np.ndarray]:
        """Cut ``session`` back to ``position`` tokens (never past what it held), append."""
        held = self.held.setdefault(session, [])
        assert position <= len(held), f"{session}: rewind to {position}, held {len(held)}"
        held[position:] = list(ids)
        return self.run(held)


class LocalVerifier:
    """A verifying DecoderBackend over :class:`WholeModel` (counts rewinds)."""

    def __init__(self, model: WholeModel) -> None:
        self.model = model
        self.rewinds = 0

    async def step(self, session: str, position: int, token_ids: Sequence[int]) -> TopCandidates:
        out = self.model.feed(session, position, token_ids)
        return TopCandidates.of(out[TOP_LOGITS], out[TOP_IDS])

    async def verify(
        self, session: str, position: int, token_ids: Sequence[int]
    ) -> list[TopCandidates]:
        self.rewinds += position < len(self.model.held.get(session, []))
        out = self.model.feed(session, position, token_ids)
        return trailing_candidates(out[TRAILING_TOP_LOGITS], out[TRAILING_TOP_IDS], len(token_ids))

    async def end(self, session: str) -> None:
        self.model.held.pop(session, None)


class SteadyCosts(Throughput):
    """Pass times fixed (a plain step 1 s, each further position 0.05 s, drafting free), so the
    draft length follows only the acceptance rate, whatever the machine's load: the wall-time
    tuning has its own tests (``test_generation_tuning.py``)."""

    def costs(self, kind: str) -> Costs:
        """The same at every load."""
        return Costs(plain=1.0, position=0.05, draft=0.0)


def _info(export: Path) -> DecoderInfo:
    return DecoderInfo.from_json((export / "decoder.json").read_bytes())


def _model(
    backend: object, export: Path, drafters: Callable[[], Drafter] | None
) -> GenerationModel:
    info = _info(export)
    speculation = None
    if drafters is not None:
        assert info.trailing_positions is not None
        stats = SpeculationStats()
        stats.throughput = SteadyCosts()
        speculation = Speculation(drafters, info.trailing_positions, stats)
    tokenizer = ChatTokenizer.from_file(export, info)
    return GenerationModel(backend, tokenizer, info, speculation)  # type: ignore[arg-type]


def _generate(model: GenerationModel, prompt: list[int]) -> tuple[str, int]:
    request = GenerationRequest(prompt, TOKENS, SamplingParams(temperature=0), session="s")

    async def collect() -> tuple[str, int]:
        text, finished = "", None
        async for event in generate(model, request):
            if isinstance(event, TextDelta):
                text += event.text
            elif isinstance(event, Finished):
                finished = event
        assert finished is not None
        return text, finished.usage.completion_tokens

    return asyncio.run(collect())


def _prompt(export: Path) -> list[int]:
    tokenizer = ChatTokenizer.from_file(export, _info(export))
    return [t for t in tokenizer.encode(PROMPT) if t not in _info(export).eos_token_ids]


@pytest.fixture(scope="module")
def draft(tiny_llama_dir: Path, tiny_gemma3_dir: Path) -> DraftModel:
    """tiny-gemma3 as a draft model for tiny-llama (same tokenizer, other weights)."""
    return DraftModel(tiny_gemma3_dir, tiny_llama_dir)


@pytest.fixture(scope="module")
def plain_text(tiny_llama_dir: Path) -> tuple[str, int]:
    """Greedy text without speculation."""
    return _generate(
        _model(LocalVerifier(WholeModel(tiny_llama_dir)), tiny_llama_dir, None),
        _prompt(tiny_llama_dir),
    )


def test_the_target_as_its_own_draft_accepts_every_draft(
    tiny_llama_dir: Path, plain_text: tuple[str, int]
) -> None:
    draft = DraftModel(tiny_llama_dir, tiny_llama_dir)
    # the random tiny model is seldom sure of a token: draft whatever its confidence
    model = _model(
        LocalVerifier(WholeModel(tiny_llama_dir)), tiny_llama_dir, lambda: draft.stream(0.0)
    )
    assert _generate(model, _prompt(tiny_llama_dir)) == plain_text
    assert model.speculation is not None
    stats = model.speculation.stats
    assert stats.drafted >= TOKENS // 2
    assert stats.acceptance_rate is not None and stats.acceptance_rate >= 0.9
    assert stats.passes < TOKENS // 2  # several tokens a pass


@pytest.mark.parametrize("mode", ["draft", "auto"])
def test_another_draft_model_keeps_the_greedy_text(
    tiny_llama_dir: Path, draft: DraftModel, plain_text: tuple[str, int], mode: str
) -> None:
    verifier = LocalVerifier(WholeModel(tiny_llama_dir))
    model = _model(verifier, tiny_llama_dir, drafter_for(mode, draft))  # type: ignore[arg-type]
    assert _generate(model, _prompt(tiny_llama_dir)) == plain_text
    assert model.speculation is not None and model.speculation.stats.drafted > 0
    assert verifier.rewinds > 0  # drafts were rejected and cut back


@pytest.fixture(scope="module")
def lean_llama(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama's draft-only export (``fedshard export --draft``), its head cut to half of
    its vocabulary."""
    from partitioner.models.frontdoor import export_decoder

    base = tmp_path_factory.mktemp("lean-llama")
    vocabulary = _info(tiny_llama_dir).vocab_size // 2
    export_decoder(
        "tiny-llama", base / "draft", cache_dir=base / "cache", draft_vocabulary=vocabulary
    )
    return base / "draft"


class RecordingStream:
    """A draft stream that keeps every token it proposed."""

    blocking = True

    def __init__(self, stream: DraftStream) -> None:
        self.stream = stream
        self.proposed: list[int] = []

    def prepare(self, tokens: Sequence[int]) -> None:
        self.stream.prepare(tokens)

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        drafts = self.stream.propose(tokens, count)
        self.proposed.extend(drafts)
        return drafts


def test_a_draft_only_export_drafts_kept_tokens_and_keeps_the_greedy_text(
    tiny_llama_dir: Path, lean_llama: Path, plain_text: tuple[str, int]
) -> None:
    from partitioner.models.decoders.draft_head import kept_ids, special_ids
    from partitioner.models.decoders.precision import model_scheme

    info = _info(lean_llama)
    half = _info(tiny_llama_dir).vocab_size // 2
    kept = kept_ids(info.vocab_size, special_ids(lean_llama, info), half)
    assert info.draft_vocabulary == len(kept) < info.vocab_size
    assert info.weights == "int4"
    assert "block 128" in (model_scheme(lean_llama / "model.onnx") or "")
    draft = DraftModel(lean_llama, tiny_llama_dir)
    recording = RecordingStream(draft.stream(0.0))
    model = _model(LocalVerifier(WholeModel(tiny_llama_dir)), tiny_llama_dir, lambda: recording)
    assert _generate(model, _prompt(tiny_llama_dir)) == plain_text
    assert len(recording.proposed) >= TOKENS // 2
    assert set(recording.proposed) <= set(kept)


def test_a_draft_only_export_is_not_deployed(tiny_llama_dir: Path, lean_llama: Path) -> None:
    from coordinator.deploy.cutting import refuse_draft_only
    from coordinator.errors import DeployError

    with pytest.raises(DeployError, match="draft-only export"):
        refuse_draft_only(lean_llama / "model.onnx")
    refuse_draft_only(tiny_llama_dir / "model.onnx")


def test_a_cache_tells_a_current_draft_export_from_others(
    tiny_llama_dir: Path, lean_llama: Path, tmp_path: Path
) -> None:
    from partitioner.models.decoders.draft_head import current_draft_export

    half = _info(tiny_llama_dir).vocab_size // 2
    assert current_draft_export(lean_llama, half)
    assert not current_draft_export(lean_llama, half // 2)  # cut for another vocabulary
    assert not current_draft_export(tiny_llama_dir, half)  # a whole export
    assert not current_draft_export(tmp_path, half)  # nothing there
    stale = tmp_path / "stale"
    shutil.copytree(lean_llama, stale)
    model = onnx.load(str(stale / "model.onnx"))
    for prop in model.metadata_props:
        if prop.key == SCHEME_METADATA_KEY:
            prop.value = "int4, blocks of 32"  # an older draft layout
    onnx.save(model, str(stale / "model.onnx"))
    assert not current_draft_export(stale, half)


def _kv_of(stream: DraftStream) -> list[np.ndarray]:
    return [kv.copy() for kv in stream._past]


def test_a_rolled_back_draft_cache_equals_a_fresh_one(
    tiny_llama_dir: Path, draft: DraftModel
) -> None:
    prompt = _prompt(tiny_llama_dir)
    stream = draft.stream(0.0)
    first = stream.propose(prompt, 5)
    assert len(first) == 5 and stream.held == [*prompt, *first[:4]]
    other = (first[1] + 1) % draft.info.vocab_size  # the verifier kept one draft, then differed
    text = [*prompt, first[0], other]
    again = stream.propose(text, 3)
    fresh = draft.stream(0.0)
    assert again == fresh.propose(text, 3)
    assert stream.held == fresh.held == [*text, *again[:2]]
    for mine, theirs in zip(_kv_of(stream), _kv_of(fresh), strict=True):
        assert mine.shape == theirs.shape
        np.testing.assert_allclose(mine, theirs, atol=1e-4)
    with pytest.raises(ValueError, match="holds"):
        stream.rollback(len(stream.held) + 1)


def test_a_stream_that_read_the_prompt_ahead_drafts_as_a_fresh_one(
    tiny_llama_dir: Path, draft: DraftModel
) -> None:
    prompt = _prompt(tiny_llama_dir)
    ahead = draft.stream(0.0)
    ahead.prepare(prompt)
    assert ahead.held == prompt
    text = [*prompt, 7]
    assert ahead.propose(text, 3) == draft.stream(0.0).propose(text, 3)
    assert ahead.held[: len(text)] == text and len(ahead.held) == len(text) + 2


def test_a_draft_stops_after_the_first_token_the_model_is_unsure_of(
    tiny_llama_dir: Path, draft: DraftModel
) -> None:
    prompt = _prompt(tiny_llama_dir)
    bold = draft.stream(0.0).propose(prompt, 5)
    _, confidence, past = draft.run(prompt, draft.empty())
    confidences = [confidence]
    for token in bold[:-1]:
        _, confidence, past = draft.run([token], past)
        confidences.append(confidence)
    assert all(0.0 < c < 1.0 for c in confidences), confidences
    threshold = sorted(confidences)[2]  # the third-least confident draft and above go on
    stop = next(i for i, c in enumerate(confidences) if c < threshold)
    cautious = draft.stream(threshold).propose(prompt, 5)
    assert cautious == bold[: stop + 1]  # the unsure token itself is still proposed
    assert draft.stream(1.0).propose(prompt, 5) == bold[:1]
    with pytest.raises(ValueError, match="min_confidence"):
        draft.stream(1.5)


def test_top_probability_is_the_softmax_of_the_best_logit() -> None:
    logits = np.array([3.0, 1.0, 0.5], dtype=np.float32)
    want = np.exp(3.0) / np.exp(logits.astype(np.float64)).sum()
    assert top_probability(logits) == pytest.approx(want)
    assert top_probability(np.array([[5.0]])) == 1.0


def _export_with_tokens_swapped(export: Path, out: Path) -> Path:
    """A copy of ``export`` whose tokenizer gives two tokens each other's ids."""
    shutil.copytree(export, out)
    data = json.loads((out / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = "cat", "dog"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(data))
    return out


def test_a_draft_with_another_tokenizer_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = _export_with_tokens_swapped(tiny_llama_dir, tmp_path / "other")
    with pytest.raises(DraftModelError, match=r"another tokenizer .* 2 differ"):
        check_draft_model(other, tiny_llama_dir)
    with pytest.raises(DraftModelError, match="not a decoder export"):
        check_draft_model(tmp_path, tiny_llama_dir)
    error = DraftModelError("x")
    assert (entry_of(error).status, entry_of(error).code) == (400, "draft_model_mismatch")


def test_the_store_keeps_a_checked_draft_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    store = DeploymentStore(tmp_path)
    record = ModelRecord(model_id="m", tokenizer_dir=str(tiny_llama_dir))
    store._put(record)
    with pytest.raises(DraftModelError, match="needs a draft model"):
        store.set_speculative("m", "draft")
    other = _export_with_tokens_swapped(tiny_llama_dir, tmp_path / "other")
    with pytest.raises(DraftModelError, match="another tokenizer"):
        store.set_speculative("m", "draft", str(other))
    kept = store.set_speculative("m", "draft", str(tiny_llama_dir))
    assert (kept.speculative, kept.draft_model) == ("draft", str(tiny_llama_dir))
    assert DeploymentStore(tmp_path).model("m").draft_model == str(tiny_llama_dir)  # persisted
    assert store.set_speculative("m", "lookup").draft_model == str(tiny_llama_dir)


class LosingChain:
    """A fake chain client answered by :class:`WholeModel`, keeping per-session lengths as
    agents do (rewinds included); the first pass that carries drafts loses a stage."""

    def __init__(self, model: WholeModel) -> None:
        self.model = model
        self.calls: list[tuple[str, int, int]] = []
        self.lost = False

    async def infer_async(
        self, tensors: dict[str, np.ndarray], timeout: float, session: SessionStep
    ) -> dict[str, np.ndarray]:
        held = self.model.held
        if session.end:
            held.pop(session.session_id, None)
            return {}
        ids = [int(t) for t in tensors[INPUT_IDS][0]]
        self.calls.append((session.session_id, session.position, len(ids)))
        if session.session_id not in held and session.position != 0:
            raise ChainBrokenError("SessionStateError: unknown session")
        if len(ids) > 1 and session.position > 0 and not self.lost:
            self.lost = True
            held.clear()  # the stage with every session's cache is gone
            raise ChainBrokenError("LinkError: stage 2 went away")
        return self.model.feed(session.session_id, session.position, ids)


def test_a_stage_lost_mid_speculation_replays_to_the_same_text(
    tiny_llama_dir: Path, draft: DraftModel, plain_text: tuple[str, int]
) -> None:
    chain = LosingChain(WholeModel(tiny_llama_dir))
    versions = iter(range(1, 100))
    version = [VersionRecord.model_construct(model_id="m", plan_version=next(versions))]  # type: ignore[call-arg]

    def failed(record: VersionRecord, error: Exception) -> None:
        version[0] = VersionRecord.model_construct(model_id="m", plan_version=next(versions))  # type: ignore[call-arg]

    plane = DataPlane()
    try:
        backend = ChainDecoderBackend(plane, lambda _: (version[0], chain), failed)  # type: ignore[arg-type,return-value]
        got = _generate(_model(backend, tiny_llama_dir, draft.stream), _prompt(tiny_llama_dir))
    finally:
        plane.close()
    assert got == plain_text
    assert chain.lost
    replays = [c for c in chain.calls if "~" in c[0]]
    assert replays and replays[0][1] == 0  # the history, re-prefilled on the new chain
    assert chain.model.held == {}  # the session was ended on the new chain


_IDLE_CPU = """
import sys, time
from pathlib import Path
from coordinator.generation.draft_model import DraftModel
draft = DraftModel(Path(sys.argv[1]), Path(sys.argv[1]), threads=2)
ids = list(range(3, 9))
for _ in range(5):
    draft.run(ids, draft.empty())
    start = time.process_time()
    time.sleep(0.05)
    print(time.process_time() - start)
"""


def test_a_draft_model_leaves_the_cores_alone_between_drafts(tiny_llama_dir: Path) -> None:
    """ONNX Runtime's worker threads spin for tens of milliseconds after a run unless told not
    to; beside the stages verifying the draft they would take a core from them (a 1.5B pass
    verifying one draft took 9 ms more with a two-thread drafter spinning). In a process of its
    own (nothing else running), the draft model's threads use almost no CPU time in the 50 ms
    after each call: about 34 ms without ``session.force_spinning_stop``."""
    out = subprocess.run(
        [sys.executable, "-c", _IDLE_CPU, str(tiny_llama_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.split()
    idle_cpu = sorted(float(x) for x in out)
    assert len(idle_cpu) == 5
    assert idle_cpu[2] < 0.01, idle_cpu  # the median of five idle spells
