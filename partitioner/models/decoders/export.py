"""Export a decoder to ``OUT_DIR`` following :mod:`protocols.decoder`.

``OUT_DIR/model.onnx`` carries its :class:`~protocols.decoder.DecoderInfo` in the metadata
(:data:`~protocols.decoder.DECODER_METADATA_KEY`) and real sample inputs (a one-token step
after a five-token prompt, :data:`~partitioner.analysis.samples.SAMPLE_INPUTS_KEY`) for
``fedshard split --verify``. The graph is traced with a non-empty past and several new tokens
so that no dimension specialises, then checked in ONNX Runtime against torch on both the
embedded step and a prefill with an empty past. Its products run on at least two rows
(:func:`~partitioner.models.decoders.rowwise.at_least_two_rows`), and the written graph is
probed for decoding a verify pass as one-token steps, bit for bit (the verdict is recorded in
``rows_independent`` and ``rows_probed``).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hostkit.files import file_sha256
from partitioner.errors import GraphError
from partitioner.models.decoders.progress import Steps
from partitioner.models.decoders.sources import DecoderSource
from partitioner.models.decoders.wrapper import decoder_module, use_grouped_attention
from protocols.decoder import (
    ATTENTION_MASK,
    DECODER_FILE,
    DECODER_METADATA_KEY,
    INPUT_IDS,
    MODEL_FILE,
    POSITION_IDS,
    TOP_IDS,
    TOP_LOGITS,
    TRAILING_POSITIONS,
    TRAILING_TOP_IDS,
    TRAILING_TOP_LOGITS,
    DecoderInfo,
    StatePair,
    past_name,
    present_name,
)

DEFAULT_TOP_K = 64
BATCH = "batch"
MAX_BATCH = 64
SAMPLE_TEXT = "The devices of a local network share one model and generate text together."
SAMPLE_PAST = 5
"""Tokens of context in the embedded sample step (a one-token step follows them)."""
TRACE_STEP = 3
"""New tokens in the step the graph is traced with (after :data:`SAMPLE_PAST` past tokens)."""
TRACED_DIR = "traced"
"""Scratch sub-directory of the output for the exporter's own file (removed when done)."""


@dataclass(frozen=True)
class DecoderExport:
    """What ``export_decoder`` wrote and how closely ONNX Runtime matches torch."""

    directory: Path
    model_path: Path
    info: DecoderInfo
    max_abs_diff: float
    """Largest difference between ONNX Runtime and torch (top logits and every present),
    over the embedded step and an empty-past prefill."""
    param_bytes: int


def decoder_info(source: DecoderSource, top_k: int) -> DecoderInfo:
    """The ``decoder.json`` document for ``source``."""
    config = source.model.config
    layers = int(config.num_hidden_layers)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bos = getattr(config, "bos_token_id", None)
    return DecoderInfo(
        model=source.name,
        architecture=type(source.model).__name__,
        num_layers=layers,
        hidden_size=int(config.hidden_size),
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=int(head_dim),
        vocab_size=int(config.vocab_size),
        top_k=top_k,
        max_context=int(config.max_position_embeddings),
        sliding_window=source.sliding_window,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=list(source.eos_token_ids),
        chat_template=source.tokenizer.chat_template or None,
        state=[
            StatePair(past=past_name(i, kind), present=present_name(i, kind))
            for i in range(layers)
            for kind in ("key", "value")
        ],
        trailing_positions=TRAILING_POSITIONS,
    )


def state_names(info: DecoderInfo) -> tuple[list[str], list[str]]:
    """``(graph input names, graph output names)`` in graph order."""
    inputs = [INPUT_IDS, ATTENTION_MASK, POSITION_IDS] + [p.past for p in info.state]
    outputs = [TOP_LOGITS, TOP_IDS, TRAILING_TOP_LOGITS, TRAILING_TOP_IDS]
    outputs += [p.present for p in info.state]
    return inputs, outputs


def step_feeds(ids: Sequence[int], past: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Positional inputs for a step of ``ids`` after ``past`` (k0, v0, k1, ...)."""
    seen = int(past[0].shape[2])
    q = len(ids)
    return [
        np.asarray([list(ids)], dtype=np.int64),
        np.ones((1, seen + q), dtype=np.int64),
        np.arange(seen, seen + q, dtype=np.int64)[None, :],
        *past,
    ]


def empty_past(info: DecoderInfo) -> list[np.ndarray]:
    """Zero-length keys and values for every layer."""
    shape = (1, info.num_kv_heads, 0, info.head_dim)
    return [np.zeros(shape, dtype=np.float32) for _ in info.state]


def export_decoder(
    source: DecoderSource,
    out_dir: Path,
    *,
    top_k: int = DEFAULT_TOP_K,
    steps: Steps | None = None,
    release_weights: bool = False,
) -> DecoderExport:
    """Write ``model.onnx``, ``decoder.json`` and the tokenizer files to ``out_dir``.

    Weights past the protobuf limit go to ``model.onnx.data`` (streamed, never one message).
    ``release_weights``: free the torch model's weights once the graph is written, before
    ONNX Runtime loads it for the check (``source.model`` is unusable afterwards); this keeps
    a 1.5B model's export within one float32 copy of its weights.
    """
    import torch

    steps = steps or Steps()
    vocab = int(source.model.config.vocab_size)
    if not 1 <= top_k <= vocab:
        raise GraphError(f"top_k must be between 1 and the vocabulary size {vocab}, got {top_k}")
    info = decoder_info(source, top_k)
    ids = _sample_ids(source.tokenizer, SAMPLE_PAST + TRACE_STEP)
    previous = use_grouped_attention(source.model)
    try:
        module = decoder_module(
            source.model,
            top_k=top_k,
            sliding_window=source.sliding_window,
            mask_dict=source.mask_dict,
        )
        with torch.no_grad():
            cases = _torch_cases(module, info, ids)
        with steps.step(f"exporting {source.name} to ONNX"):
            program = _trace(module, info, cases["trace"][0])
        model = _save_traced(program, info, out_dir, steps)
        del program
    finally:
        source.model.set_attn_implementation(previous)
    if release_weights:
        source.model.to("meta")
    return _write(source, info, model, cases, out_dir, steps)


def _sample_ids(tokenizer: Any, count: int) -> list[int]:
    ids = [int(i) for i in tokenizer(SAMPLE_TEXT)["input_ids"]]
    if len(ids) < count:
        raise GraphError(f"sample text gives {len(ids)} tokens, need {count}")
    return ids[:count]


def _run_torch(module: Any, feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
    import torch

    outputs = module(*(torch.from_numpy(f) for f in feeds))
    return [o.numpy() for o in outputs]


def _torch_cases(
    module: Any, info: DecoderInfo, ids: Sequence[int]
) -> dict[str, tuple[list[np.ndarray], list[np.ndarray]]]:
    """Inputs and torch outputs: ``prefill`` (empty past), ``step`` (the embedded samples:
    one token after :data:`SAMPLE_PAST`) and ``trace`` (several tokens after the same past)."""
    prefill_in = step_feeds(ids[:SAMPLE_PAST], empty_past(info))
    prefill_out = _run_torch(module, prefill_in)
    past = prefill_out[4:]  # after top_logits, top_ids and the trailing pair
    next_token = int(prefill_out[1][0, 0])
    step_in = step_feeds([next_token], past)
    # two identical rows: a batch axis traced at size 1 would be fixed to 1 in the graph
    trace_in = [np.concatenate([f, f]) for f in step_feeds(ids[SAMPLE_PAST:], past)]
    return {
        "prefill": (prefill_in, prefill_out),
        "step": (step_in, _run_torch(module, step_in)),
        "trace": (trace_in, []),
    }


def _trace(module: Any, info: DecoderInfo, feeds: Sequence[np.ndarray]) -> Any:
    import torch

    inputs, outputs = state_names(info)
    free = torch.export.Dim.DYNAMIC
    batch = torch.export.Dim(BATCH, max=MAX_BATCH)  # one symbol, first seen on input_ids
    dynamic = (
        {0: batch, 1: free},
        {0: batch, 1: free},
        {0: batch, 1: free},
        tuple({0: batch, 2: free} for _ in info.state),
    )
    args = tuple(torch.from_numpy(f) for f in feeds)
    with torch.no_grad():
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=dynamic,
            verbose=False,
        )
    if program is None:
        raise GraphError("torch.onnx.export returned no program")
    return program


def _save_traced(program: Any, info: DecoderInfo, out_dir: Path, steps: Steps) -> Any:
    """The traced graph as a ``ModelProto`` whose weights stay in a scratch data file
    (``out_dir/traced``), with the batch read from ``input_ids`` and named dimensions."""
    import onnx

    traced = out_dir / TRACED_DIR / MODEL_FILE
    traced.parent.mkdir(parents=True, exist_ok=True)
    with steps.step("writing the traced graph and its weights"):
        program.save(str(traced), external_data=True)
    model = onnx.load(str(traced), load_external_data=False)
    _batch_from_input_ids(model, info)
    _name_dims(model, info)
    return model


def _batch_from_input_ids(model: Any, info: DecoderInfo) -> None:
    """Read the batch size from ``input_ids``, never from a key/value tensor.

    The exporter takes the batch symbol's value from whichever input carries it, sometimes a
    layer's past; every layer's reshapes would then read that one layer's cache, which only
    its own stage holds. All inputs share the batch axis by construction, so reading it from
    ``input_ids`` is the same value.
    """
    kv = {n for p in info.state for n in (p.past, p.present)}
    for node in model.graph.node:
        if node.op_type != "Shape" or node.input[0] not in kv:
            continue
        attrs = {a.name: a.i for a in node.attribute}
        if attrs.get("start", 0) == 0 and attrs.get("end") == 1:
            node.input[0] = INPUT_IDS


def _name_dims(model: Any, info: DecoderInfo) -> None:
    """Readable symbolic dimensions, the same name for one symbol everywhere in the graph.

    The exporter's own symbols (``s0``, ``s1``, ...) are renamed on the inputs and outputs and
    in every ``value_info``, so a segment cut from the graph declares, e.g., its hidden-state
    input as ``[batch, sequence, hidden]`` like the model's outputs (an agent batches requests
    along a shared free first axis).
    """
    past = {p.past for p in info.state}
    present = {p.present for p in info.state}
    names = {
        INPUT_IDS: {0: BATCH, 1: "sequence"},
        POSITION_IDS: {0: BATCH, 1: "sequence"},
        ATTENTION_MASK: {0: BATCH, 1: "total_sequence"},
        TOP_LOGITS: {0: BATCH},
        TOP_IDS: {0: BATCH},
        TRAILING_TOP_LOGITS: {0: BATCH, 1: "trailing"},
        TRAILING_TOP_IDS: {0: BATCH, 1: "trailing"},
    }
    renamed: dict[str, str] = {}
    for value in [*model.graph.input, *model.graph.output]:
        if value.name in past:
            axes = {0: BATCH, 2: "past_sequence"}
        elif value.name in present:
            axes = {0: BATCH, 2: "total_sequence"}
        else:
            axes = names.get(value.name, {})
        dims = value.type.tensor_type.shape.dim
        for axis, label in axes.items():
            if axis < len(dims) and not dims[axis].HasField("dim_value"):
                if dims[axis].dim_param:
                    renamed.setdefault(dims[axis].dim_param, label)
                dims[axis].dim_param = label
    for value in model.graph.value_info:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renamed:
                dim.dim_param = renamed[dim.dim_param]


def _write(
    source: DecoderSource,
    info: DecoderInfo,
    model: Any,
    cases: dict[str, tuple[list[np.ndarray], list[np.ndarray]]],
    out_dir: Path,
    steps: Steps,
) -> DecoderExport:
    # heavy: keeps onnx off a light import
    from partitioner.analysis.modelio import initializer_bytes

    # heavy: keeps onnx off a light import
    from partitioner.analysis.samples import SAMPLE_INPUTS_KEY, encode_samples

    # heavy: keeps onnx off a light import
    from partitioner.models.decoders.precision import SCHEME_METADATA_KEY, SCHEMES

    # heavy: keeps onnx off a light import
    from partitioner.models.decoders.rowwise import at_least_two_rows, probe_rows

    inputs, _ = state_names(info)
    samples = dict(zip(inputs, cases["step"][0], strict=True))
    at_least_two_rows(model, weight_products=True)
    entry = model.metadata_props.add()
    entry.key, entry.value = SCHEME_METADATA_KEY, SCHEMES["fp32"]
    for key, value in ((DECODER_METADATA_KEY, info.to_json()), (SAMPLE_INPUTS_KEY, None)):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value if value is not None else encode_samples(samples)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / MODEL_FILE
    with steps.step(f"writing {path}"):
        _save_export(model, path, out_dir / TRACED_DIR)
        shutil.rmtree(out_dir / TRACED_DIR)
        (out_dir / DECODER_FILE).write_text(info.to_json() + "\n")
        source.tokenizer.save_pretrained(out_dir)
    with steps.step("checking ONNX Runtime against torch"):
        diff = _check(path, info, cases)
    with steps.step("checking that a token decodes alike alone and in a verify pass"):
        alike = probe_rows(out_dir)
    info = info.model_copy(update={"rows_independent": alike, "rows_probed": True})
    return DecoderExport(out_dir, path, info, diff, initializer_bytes(model))


def _save_export(model: Any, path: Path, traced: Path) -> None:
    """Save the graph; its weights are inlined when small, else the exporter's data file is
    moved next to it (no second copy of gigabytes) and its SHA-256 recorded, as
    :func:`~partitioner.analysis.modelio.save_model` records it."""
    import onnx

    # heavy: keeps onnx off a light import
    from partitioner.analysis.modelio import (
        EXTERNAL_DATA_MARGIN_BYTES,
        EXTERNAL_DATA_SHA256_KEY,
        PROTOBUF_LIMIT_BYTES,
        initializer_bytes,
        save_model,
    )

    data = traced / f"{MODEL_FILE}.data"
    if initializer_bytes(model) <= PROTOBUF_LIMIT_BYTES - EXTERNAL_DATA_MARGIN_BYTES:
        save_model(model, path, source_dir=traced)
        return
    target = path.with_name(data.name)
    data.replace(target)
    entry = model.metadata_props.add()
    entry.key, entry.value = EXTERNAL_DATA_SHA256_KEY, file_sha256(target)
    onnx.save_model(model, str(path))  # the graph only: its tensors point into the data file


def _check(
    path: Path, info: DecoderInfo, cases: dict[str, tuple[list[np.ndarray], list[np.ndarray]]]
) -> float:
    import onnxruntime as ort

    # heavy: keeps onnx off a light import
    from partitioner.cutting.verify import compare

    inputs, outputs = state_names(info)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    worst = 0.0
    for case in ("prefill", "step"):
        feeds, expected = cases[case]
        values = session.run(outputs, dict(zip(inputs, feeds, strict=True)))
        got = dict(zip(outputs, values, strict=True))
        want = dict(zip(outputs, expected, strict=True))
        if int(got[TOP_IDS][0, 0]) != int(want[TOP_IDS][0, 0]):
            raise GraphError(f"{path}: ONNX Runtime picks another next token than torch ({case})")
        del want[TOP_IDS], want[TRAILING_TOP_IDS]
        worst = max(worst, *compare(want, got).values())
    return worst
