"""A draft model's leaner graph (``fedshard export --draft``): less to read each drafting step.

A draft model only proposes tokens that the served model verifies, so its graph may give up a
little of its own accuracy for a cheaper step without changing a single generated token. A
drafting step is bound by reading weights, so both changes here cut the bytes a step reads:

- **int4 in coarser blocks**: :data:`DRAFT_BLOCK_SIZE` weights per scale and zero point rather
  than the served models' 32 (at 32 the scales and zero points add 28 % to the 4-bit weights,
  at 128 they add 7 %);
- **an output head over the most frequent tokens** (FR-Spec, Zhao et al., ACL 2025): the head
  scores only :data:`DRAFT_VOCABULARY` tokens, plus the tokenizer's special ones (the end of a
  turn must stay proposable). Qwen2.5-Coder-0.5B's head is 151,936 x 896, over a quarter of its
  weights, read whole for every drafted token. Byte-level BPE numbers its pieces in merge
  order, most frequent first, so the first ids are the ones text uses most. A draft then never
  proposes a rarer token; the served model still generates it, as the one token a verifying
  pass always adds.

Measured on Qwen2.5-Coder-0.5B drafting for the 1.5B model's greedy chat answer (README,
"Draft-only exports"): a step 9.3-10.0 ms against 12.7-13.9 ms for its plain int4 export on 2
threads; its greedy token matched the 1.5B model's at 63 of 87 positions against 64.

:func:`lean_head` is ``ModelProto`` in, ``ModelProto`` out; :func:`write_draft_decoder` is the
file layer over a ``fedshard.decoder/1`` directory.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from partitioner.analysis.modelio import initializer_bytes, save_model
from partitioner.errors import GraphError
from partitioner.models.decoders.precision import (
    SCHEME_METADATA_KEY,
    Int4Layout,
    Report,
    converted_decoder,
    model_scheme,
)
from partitioner.models.decoders.progress import Steps
from partitioner.models.decoders.weights import DRAFT_BLOCK_SIZE, DRAFT_VOCABULARY
from protocols.decoder import DECODER_FILE, DECODER_METADATA_KEY, MODEL_FILE, DecoderInfo

DRAFT_INT4 = Int4Layout(block_size=DRAFT_BLOCK_SIZE, two_rows=False)
"""How a draft export stores its weights: coarser blocks, and the float products on the rows
there are (the served models pad them to two rows so that a row decodes alike alone and in a
verify pass; a draft model's proposals need no such guarantee)."""
VOCABULARY_IDS = "draft_vocabulary_ids"
"""The initializer mapping a lean head's columns back to token ids."""
_MAX_SPECIAL = 4096
"""More special tokens than any tokenizer has beyond its frequent ones (Qwen2.5 has 22): an
export keeping ``vocabulary`` plus up to this many ids was cut for ``vocabulary``."""
_WALK_OPS = frozenset({"Gather", "Slice", "Reshape", "Squeeze", "Identity"})
"""Operators between the output head and a ``TopK`` that keep its last axis."""


def kept_ids(vocab_size: int, special: Iterable[int], size: int) -> list[int]:
    """The token ids a draft head of ``size`` scores: ids below ``size`` and every ``special``
    id of the vocabulary, ascending."""
    if size < 1:
        raise GraphError(f"a draft vocabulary needs at least one token, not {size}")
    return sorted(set(range(min(size, vocab_size))) | {i for i in special if 0 <= i < vocab_size})


def lean_head(model: onnx.ModelProto, keep: Sequence[int]) -> onnx.ModelProto:
    """``model`` with its output head scoring only the token ids ``keep`` (ascending).

    The head is the ``MatMulNBits`` (or ``MatMul`` with a constant weight) whose output every
    ``TopK`` ranks; its weight keeps the ``keep`` rows (columns for ``MatMul``), and each
    ``TopK``'s ids go through a ``Gather`` of ``keep`` so that the graph still returns token
    ids. :class:`GraphError` when there is no such head, or ``keep`` cuts nothing.
    """
    graph = model.graph
    topks = [n for n in graph.node if n.op_type == "TopK"]
    if not topks:
        raise GraphError("the graph has no TopK: not a decoder export")
    producers = {out: node for node in graph.node for out in node.output}
    heads = [_head_of(producers, n) for n in topks]
    if len({head.name for head in heads}) != 1:
        raise GraphError(f"the TopKs rank {len({h.name for h in heads})} different heads, not one")
    _cut_head(graph, heads[0], np.asarray(keep, dtype=np.int64))
    graph.initializer.append(numpy_helper.from_array(np.asarray(keep, np.int64), VOCABULARY_IDS))
    for topk in topks:
        ids, local = topk.output[1], f"{topk.output[1]}_in_draft_vocabulary"
        topk.output[1] = local
        graph.node.append(
            helper.make_node("Gather", [VOCABULARY_IDS, local], [ids], name=f"{ids}_to_token_ids")
        )
    return model


def _head_of(producers: dict[str, onnx.NodeProto], topk: onnx.NodeProto) -> onnx.NodeProto:
    """The node producing the scores ``topk`` ranks (``producers``: each node by its outputs),
    through shape-only operators."""
    node = producers.get(topk.input[0])
    while node is not None and node.op_type in _WALK_OPS:
        node = producers.get(node.input[0])
    if node is None or node.op_type not in ("MatMulNBits", "MatMul"):
        found = "a graph input" if node is None else node.op_type
        raise GraphError(f"the TopK {topk.name!r} ranks {found}, not an output head")
    head: onnx.NodeProto = node
    return head


def _cut_head(graph: onnx.GraphProto, head: onnx.NodeProto, keep: np.ndarray) -> None:
    """Keep only the ``keep`` outputs of ``head``: new initializers, the old ones dropped when
    nothing else reads them."""
    weights = {t.name: t for t in graph.initializer}
    if head.op_type == "MatMulNBits":
        names = list(head.input[1:])
        width = next(a.i for a in head.attribute if a.name == "N")
    else:
        names = [head.input[1]]
        width = int(weights[names[0]].dims[-1]) if names[0] in weights else 0
    if any(name and name not in weights for name in names):
        raise GraphError(f"the output head {head.name!r} has a weight that is not constant")
    if len(keep) >= width or int(keep[-1]) >= width:
        raise GraphError(f"a draft vocabulary of {len(keep)} cuts nothing from {width} outputs")
    for position, name in enumerate(names, start=1):
        if not name:
            continue
        array = numpy_helper.to_array(weights[name])
        lean = array[keep] if head.op_type == "MatMulNBits" else array[..., keep]
        graph.initializer.append(numpy_helper.from_array(lean, f"{name}_draft"))
        head.input[position] = f"{name}_draft"
        if not any(name in node.input for node in graph.node):
            graph.initializer.remove(weights[name])
    for attribute in head.attribute:
        if attribute.name == "N":
            attribute.i = len(keep)


def special_ids(export_dir: Path, info: DecoderInfo) -> set[int]:
    """The end-of-text ids and the tokenizer's added (special) tokens of an export."""
    file = export_dir / "tokenizer.json"
    added = json.loads(file.read_text()).get("added_tokens", []) if file.is_file() else []
    return set(info.eos_token_ids) | {int(token["id"]) for token in added}


def write_draft_decoder(
    src_dir: Path,
    dst_dir: Path,
    *,
    vocabulary: int = DRAFT_VOCABULARY,
    steps: Steps | None = None,
) -> Report:
    """Write the float32 decoder export in ``src_dir`` to ``dst_dir`` as a draft-only export:
    int4 in blocks of :data:`DRAFT_BLOCK_SIZE`, the head cut to ``vocabulary`` tokens
    (:func:`lean_head`), ``decoder.json``'s ``draft_vocabulary`` set (so it is not served).
    Rows are not probed as the served exports' are (a draft needs no row exactness), and
    ``rows_independent`` says none is promised."""
    steps = steps or Steps()
    report, model = converted_decoder(src_dir, dst_dir, "int4", steps=steps, layout=DRAFT_INT4)
    info_file, model_file = dst_dir / DECODER_FILE, dst_dir / MODEL_FILE
    info = DecoderInfo.from_json(info_file.read_bytes())
    keep = kept_ids(info.vocab_size, special_ids(dst_dir, info), vocabulary)
    with steps.step(f"cutting the output head to {len(keep)} of {info.vocab_size} tokens"):
        model = lean_head(model, keep)
    # unprobed, and without the two-row products a row may differ alone and in a pass
    info = info.model_copy(update={"draft_vocabulary": len(keep), "rows_independent": False})
    for prop in model.metadata_props:
        if prop.key == DECODER_METADATA_KEY:
            prop.value = info.to_json()
        elif prop.key == SCHEME_METADATA_KEY:
            prop.value = draft_scheme(len(keep))
    with steps.step(f"writing {model_file}"):
        save_model(model, model_file)
    info_file.write_text(info.to_json() + "\n")
    return replace(report, weight_bytes=initializer_bytes(model))


def draft_scheme(kept: int) -> str:
    """The storage scheme a draft export records (see :data:`precision.SCHEMES`)."""
    return f"{DRAFT_INT4.scheme}, output head of {kept} tokens"


def current_draft_export(export_dir: Path, vocabulary: int = DRAFT_VOCABULARY) -> bool:
    """Whether ``export_dir`` holds a draft-only export of ``vocabulary`` frequent tokens stored
    the current way (:func:`draft_scheme`); a cache should export anything else again."""
    info_file, model_file = export_dir / DECODER_FILE, export_dir / MODEL_FILE
    if not (info_file.is_file() and model_file.is_file()):
        return False
    kept = DecoderInfo.from_json(info_file.read_bytes()).draft_vocabulary
    if kept is None or not vocabulary <= kept < vocabulary + _MAX_SPECIAL:
        return False
    return model_scheme(model_file) == draft_scheme(kept)
