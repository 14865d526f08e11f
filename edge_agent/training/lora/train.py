"""One round of federated LoRA on a device: frozen segments in ONNX Runtime, the tail in torch.

1. Records: this device's text (:mod:`~edge_agent.training.text_data`), tokenized with the
   version's own ``tokenizer.json`` (hash-checked against the plan), cut to ``max_tokens`` and
   right-padded. Right padding is exact here: attention is causal, so no real token sees a pad.
2. Frozen prefix: the segments before the first trainable one run in ONNX Runtime, one at a
   time, and their residual-stream output (the plan's ``boundary``) is cached on disk.
3. The tail (:mod:`.model`) trains only its adapters with the causal-LM loss. With
   ``plan.dp`` it is record-level DP-SGD through Opacus (Poisson sampling, per-example clipping
   to ``max_grad_norm``, Gaussian noise), and Opacus' RDP accountant composes every round of the
   run (its history is kept in the cache dir), so the reported epsilon is per record, for the run.
4. Held-out records are only evaluated: the global model's loss before training, the local
   model's after.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import resource
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import onnx
from onnx import numpy_helper

from edge_agent.training.errors import PlanMismatchError
from edge_agent.training.local import MANIFEST_FILE, LocalSettings
from edge_agent.training.text_data import load_text
from hostkit.files import file_sha256
from protocols.errors import SchemaError
from protocols.lora import LoraPlan
from protocols.manifest import Manifest

if TYPE_CHECKING:
    from edge_agent.training.lora.loop import LoopResult
    from edge_agent.training.lora.pairs import PreparedPairs

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
PREFIX_BATCH = 32
FLOAT_TYPES = (onnx.TensorProto.FLOAT,)
QUANTIZED_TYPES = (
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.INT4,
    onnx.TensorProto.UINT4,
)
"""Initializer types that hold quantized weights (counted as trained-segment bytes)."""


@dataclass(frozen=True)
class LoraResult:
    """What a LoRA round produced on this device."""

    arrays: list[np.ndarray]
    examples: int
    train_loss: float
    held_out_before: float
    held_out_after: float
    held_out_tokens: int
    epsilon: float | None
    trained_shard_bytes: int
    peak_rss_bytes: int
    extra: dict[str, float] = field(default_factory=dict)
    """Objective-specific metrics (an encoder's held-out recall@1 before training)."""
    mechanism: tuple[float, float, int] | None = None
    """Under DP: the round's (noise multiplier, sample rate, steps), for the ledger."""


@dataclass(frozen=True)
class Tokens:
    """Right-padded token ids and how many of each row are real."""

    ids: np.ndarray
    lengths: np.ndarray


def tokenize(texts: tuple[str, ...], tokenizer_path: Path, max_tokens: int) -> Tokens:
    """Encode with the ``tokenizers`` library (special tokens as the tokenizer adds them)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.no_padding()  # a tokenizer.json may pad to a fixed length (MiniLM's pads to 128)
    encoded = [tok.encode(t).ids[:max_tokens] for t in texts]
    width = max(len(e) for e in encoded)
    ids = np.zeros((len(encoded), width), dtype=np.int64)
    for row, e in enumerate(encoded):
        ids[row, : len(e)] = e
    return Tokens(ids, np.array([len(e) for e in encoded], dtype=np.int64))


class SegmentFiles(Sequence[bytes]):
    """A version's segment files, hash-checked at load, read one at a time when indexed (so a
    round never holds every segment's bytes at once); each read is checked against the hash
    again, so a file replaced after the check is refused."""

    def __init__(self, paths: Sequence[Path], digests: Sequence[str]) -> None:
        self._paths = list(paths)
        self._digests = list(digests)

    def __len__(self) -> int:
        return len(self._paths)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> SegmentFiles: ...

    def __getitem__(self, index: int | slice) -> bytes | SegmentFiles:
        if isinstance(index, slice):
            return SegmentFiles(self._paths[index], self._digests[index])
        data = self._paths[index].read_bytes()
        if hashlib.sha256(data).hexdigest() != self._digests[index]:
            raise PlanMismatchError(f"{self._paths[index]} changed after it was checked")
        return data


def _file_sha256(path: Path) -> str:
    try:
        return file_sha256(path)
    except OSError as exc:
        raise PlanMismatchError(f"{path}: unreadable segment: {exc}") from exc


def load_version(plan: LoraPlan, segments_dir: Path) -> tuple[Manifest, SegmentFiles]:
    """The local segments, checked against the manifest and the plan's hashes (streamed: no
    segment is held in memory here)."""
    try:
        manifest = Manifest.from_json((segments_dir / MANIFEST_FILE).read_bytes())
    except (OSError, SchemaError) as exc:
        raise PlanMismatchError(f"{segments_dir}: no usable manifest: {exc}") from exc
    want = {s.index: s.sha256 for s in plan.segments}
    if [e.index for e in manifest.segments] != sorted(want):
        raise PlanMismatchError("the local version has other segments than the plan")
    paths = []
    for entry in manifest.segments:
        path = segments_dir / entry.file
        digest = _file_sha256(path)
        if digest != entry.sha256 or digest != want[entry.index]:
            raise PlanMismatchError(f"segment {entry.index} differs from the server's version")
        paths.append(path)
    tok = segments_dir / TOKENIZER_FILE
    if not tok.is_file() or hashlib.sha256(tok.read_bytes()).hexdigest() != plan.tokenizer_sha256:
        raise PlanMismatchError(f"{tok}: missing or not the plan's tokenizer")
    return manifest, SegmentFiles(paths, [want[e.index] for e in manifest.segments])


def _zeros_for(value: Any, batch: int) -> np.ndarray:
    """An empty past ``[batch, kv_heads, 0, head_dim]`` for a KV input of a segment."""
    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in value.type.tensor_type.shape.dim]
    dims[0] = batch
    return np.zeros(dims, dtype=np.float32)


def _with_output(blob: bytes, name: str) -> tuple[bytes, bool]:
    """The segment, with ``name`` added as a graph output when one of its nodes makes it."""
    model = onnx.load_from_string(blob)
    if name in {o.name for o in model.graph.output}:
        return blob, True
    if not any(name in node.output for node in model.graph.node):
        return blob, False
    model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    return model.SerializeToString(), True


def prefix_hidden(
    blobs: Sequence[bytes], tokens: Tokens, boundary: str, bidirectional: bool = False
) -> np.ndarray:
    """The residual stream at ``boundary`` for every row: the segments up to the one that makes
    it run in ONNX Runtime, one at a time (``boundary`` may be inside a segment). An encoder
    (``bidirectional``) gets the real attention mask and zero ``token_type_ids``; a causal
    decoder's right pads are never seen by a real token, so its mask is all ones."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    rows, width = tokens.ids.shape
    envs: list[dict[str, np.ndarray]] = []
    for s in range(0, rows, PREFIX_BATCH):
        ids = tokens.ids[s : s + PREFIX_BATCH]
        positions = np.broadcast_to(np.arange(width, dtype=np.int64), ids.shape).copy()
        mask = np.ones_like(ids)
        if bidirectional:
            mask = (positions < tokens.lengths[s : s + PREFIX_BATCH, None]).astype(np.int64)
        envs.append(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "position_ids": positions,
                "token_type_ids": np.zeros_like(ids),
            }
        )
    for original in blobs:  # one segment resident at a time
        blob, makes_it = _with_output(original, boundary)
        session = ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])
        inputs = {v.name: v for v in onnx.load_from_string(original).graph.input}
        for env in envs:
            feeds = {
                name: env[name] if name in env else _zeros_for(inputs[name], len(env["input_ids"]))
                for name in inputs
            }
            for meta, value in zip(session.get_outputs(), session.run(None, feeds), strict=True):
                if not meta.name.startswith("present."):
                    env[meta.name] = np.asarray(value)
        del session
        if makes_it:
            return np.concatenate([env[boundary] for env in envs]).astype(np.float32)
    raise PlanMismatchError(f"no local segment makes {boundary!r}")


def cached_prefix(
    plan: LoraPlan, blobs: Sequence[bytes], tokens: Tokens, data_sha: str, cache_dir: Path
) -> np.ndarray:
    """:func:`prefix_hidden`, cached by the frozen segments' hashes, boundary and data."""
    frozen = [s.sha256 for s in plan.segments if s.index <= plan.trainable[0]]
    key = hashlib.sha256(
        json.dumps([frozen, plan.boundary, data_sha, tokens.ids.shape, plan.max_tokens]).encode()
    ).hexdigest()
    path = cache_dir / f"lora-prefix-{key[:32]}.npy"
    if path.is_file():
        cached: np.ndarray = np.load(path, allow_pickle=False)
        return cached
    hidden = prefix_hidden(
        blobs[: plan.trainable[0] + 1], tokens, plan.boundary, plan.objective == "contrastive"
    )
    cache_dir.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.save(buf, hidden, allow_pickle=False)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)
    return hidden


def trainable_initializers(
    plan: LoraPlan, blobs: Sequence[bytes], wanted: set[str]
) -> tuple[dict[str, np.ndarray], int]:
    """The ``wanted`` initializers of the trainable segments (by name; a quantized one
    dequantized, as its plan reference says), and the bytes the weights of those segments are
    stored in (float32 initializers and quantized weights with their scales and zero points:
    what the adapters are measured against)."""
    from protocols.quant import dequantize

    quantized = {
        ref.initializer: ref.quantized
        for refs in plan.weight_map.values()
        for ref in refs
        if ref.quantized is not None
    }
    arrays: dict[str, np.ndarray] = {}
    total = 0
    models = [onnx.load_from_string(blobs[index]) for index in plan.trainable]
    # a quantized weight's scale may sit in a later segment than its data (with its reader)
    inits = {t.name: t for model in models for t in model.graph.initializer}
    for model in models:
        for tensor in model.graph.initializer:
            if tensor.data_type in FLOAT_TYPES:
                total += 4 * int(np.prod(tensor.dims))
            elif tensor.data_type in QUANTIZED_TYPES:
                total += len(tensor.raw_data) or tensor.ByteSize()
            if tensor.name not in wanted or tensor.name in arrays:
                continue
            quant = quantized.get(tensor.name)
            if quant is None:
                arrays[tensor.name] = numpy_helper.to_array(tensor)
                continue
            if quant.scale not in inits:
                raise PlanMismatchError(f"no local segment holds {quant.scale}")
            zero = inits.get(quant.zero_point or "")
            arrays[tensor.name] = dequantize(
                quant,
                numpy_helper.to_array(tensor),
                numpy_helper.to_array(inits[quant.scale]),
                None if zero is None else numpy_helper.to_array(zero),
            )
    return arrays, total


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class Prepared:
    """A device's round, ready to train: the tail with the global adapters, and its data."""

    tail: Any
    pairs: list[Any]
    train: tuple[np.ndarray, Tokens]
    held_out: tuple[np.ndarray, Tokens] | None
    examples: int
    trained_shard_bytes: int


def prepare(plan: LoraPlan, arrays: list[np.ndarray], settings: LocalSettings) -> Prepared:
    """Read and tokenize the records, run (or reuse) the frozen prefix, build the tail."""
    from edge_agent.training.lora.model import (
        adapter_pairs,
        build_tail,
        set_adapters,
        tail_initializers,
    )

    records = load_text(settings.data_dir)
    _, blobs = load_version(plan, settings.segments_dir)
    tok_path = settings.segments_dir / TOKENIZER_FILE
    cache = settings.cache_dir
    train_tokens = tokenize(records.train, tok_path, plan.max_tokens)
    train = (
        cached_prefix(plan, blobs, train_tokens, records.sha256 + "/train", cache),
        train_tokens,
    )
    held = None
    if records.held_out:
        held_tokens = tokenize(records.held_out, tok_path, plan.max_tokens)
        held = (
            cached_prefix(plan, blobs, held_tokens, records.sha256 + "/held", cache),
            held_tokens,
        )
    weights, trained_bytes = trainable_initializers(plan, blobs, tail_initializers(plan))
    del blobs
    tail = build_tail(plan, weights)
    pairs = adapter_pairs(tail, plan)
    set_adapters(pairs, arrays)
    return Prepared(tail, pairs, train, held, len(records.train), trained_bytes)


def evaluate_lora(
    plan: LoraPlan, arrays: list[np.ndarray], settings: LocalSettings
) -> tuple[float, int]:
    """(mean token loss, tokens) of the model with ``arrays`` on this device's held-out records."""
    from edge_agent.training.lora.loop import held_out_loss, train_threads

    if plan.objective == "contrastive":
        from edge_agent.training.lora.pairs import evaluate_pairs

        with train_threads():
            loss, count, _ = evaluate_pairs(plan, arrays, settings)
            return loss, count
    with train_threads():
        ready = prepare(plan, arrays, settings)
        held = ready.held_out
        return held_out_loss(ready.tail, *(held if held is not None else (None, None)))


def train_lora(
    plan: LoraPlan,
    arrays: list[np.ndarray],
    settings: LocalSettings,
    seed: int | None,
    round_number: int,
) -> LoraResult:
    """One round on this device; returns the adapters after local training (see module doc).
    ``seed`` fixes the shuffle of a round without DP; a DP round refuses one (its randomness
    comes from ``os.urandom``)."""
    from edge_agent.training.lora.loop import held_out_loss, run_epochs, train_threads

    if plan.objective == "contrastive":
        from edge_agent.training.lora.pairs import train_pairs

        with train_threads():
            result: LoraResult = train_pairs(plan, arrays, settings, seed, round_number)
            return result
    with train_threads():
        ready = prepare(plan, arrays, settings)
        held = ready.held_out if ready.held_out is not None else (None, None)
        before = held_out_loss(ready.tail, *held)
        loop = run_epochs(ready.tail, plan, *ready.train, seed, settings.cache_dir, round_number)
        after = held_out_loss(ready.tail, *held)
    return lora_result(ready, loop, before[0], after[0], before[1])


def lora_result(
    ready: Prepared | PreparedPairs,
    loop: LoopResult,
    before: float,
    after: float,
    held_out_count: int,
    extra: dict[str, float] | None = None,
) -> LoraResult:
    """The round's :class:`LoraResult`: the trained adapters, the held-out measure of the
    global model before and of the local one after, and the loop's loss and epsilon."""
    from edge_agent.training.lora.model import get_adapters

    return LoraResult(
        arrays=get_adapters(ready.pairs),
        examples=ready.examples,
        train_loss=loop.loss,
        held_out_before=before,
        held_out_after=after,
        held_out_tokens=held_out_count,
        epsilon=loop.epsilon,
        trained_shard_bytes=ready.trained_shard_bytes,
        peak_rss_bytes=peak_rss_bytes(),
        extra=extra or {},
        mechanism=loop.mechanism,
    )


def evaluate_lora_metrics(
    plan: LoraPlan, arrays: list[np.ndarray], settings: LocalSettings
) -> tuple[float, int, dict[str, float]]:
    """:func:`evaluate_lora` with the objective's extra metrics (an encoder's recall@1)."""
    if plan.objective != "contrastive":
        return (*evaluate_lora(plan, arrays, settings), {})
    from edge_agent.training.lora.loop import train_threads
    from edge_agent.training.lora.pairs import evaluate_pairs

    with train_threads():
        return evaluate_pairs(plan, arrays, settings)
