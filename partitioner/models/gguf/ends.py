"""The two ends of a decoder: the token embedding (first stage) and the output head (last).

Large tables are mapped in row pieces (:data:`.archs.CHUNK_VALUES`), so building them holds
one piece at a time; the head returns the top-k of the last ``trailing`` positions as
:mod:`protocols.decoder` names them. Semantics as :mod:`.archs` (llama.cpp's).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from partitioner.models.gguf import kernels
from partitioner.models.gguf.archs import Emitter, rms_norm, row_chunks
from partitioner.models.gguf.header import Architecture


def embedding(e: Emitter) -> str:
    """``input_ids`` to the first hidden state (Gemma 3: times ``sqrt(hidden)``).

    A large table is gathered in row pieces (:attr:`Emitter.chunk_values`), so mapping it
    holds one piece at a time: each piece gathers its own ids (others read its row 0) and
    zeroes the rest; the pieces' rows are summed (exact: one piece holds each id).
    """
    m = e.model
    t = m.tensor("token_embd.weight")
    raw = e.raw(t.name)
    pieces = row_chunks(m.vocab, m.hidden, e.chunk_values)
    if len(pieces) == 1:
        rows = e.part(
            kernels.gather("token_embd", "input_ids", raw, t.type, m.vocab, m.hidden, e.weights)
        )
    else:
        parts = []
        for k, (r0, r1) in enumerate(pieces):
            p = f"token_embd/{k}"
            local = e.op("Sub", ["input_ids", e.ints(f"{p}/r0", [r0])], f"{p}/local")
            low = e.op("GreaterOrEqual", [local, e.ints(f"{p}/zero", [0])], f"{p}/low")
            high = e.op("Less", [local, e.ints(f"{p}/n", [r1 - r0])], f"{p}/high")
            valid = e.op("And", [low, high], f"{p}/valid")
            safe = e.op("Where", [valid, local, e.ints(f"{p}/first", [0])], f"{p}/safe")
            name = f"token_embd.{k}"
            table = raw[r0:r1]
            got = e.part(kernels.gather(name, safe, table, t.type, r1 - r0, m.hidden, e.weights))
            keep = e.op("Unsqueeze", [valid, e.ints(f"{p}/last", [-1])], f"{p}/valid3")
            keep = e.op("Cast", [keep], f"{p}/keep", to=TensorProto.FLOAT)
            parts.append(e.op("Mul", [got, keep], f"{p}/rows"))
        rows = e.op("Sum", parts, "token_embd/out")
    if m.architecture != Architecture.GEMMA3:
        return rows
    return e.op("Mul", [rows, e.floats("embd/scale", np.sqrt(m.hidden))], "embd/scaled")


def head(e: Emitter, x: str, trailing: int, top_k: int) -> tuple[str, str, str, str]:
    """Final norm, output head (the embedding when tied) and top-k on the last ``trailing``
    positions: ``(top_logits, top_ids, trailing_top_logits, trailing_top_ids)``."""
    m = e.model
    last = e.op(
        "Slice",
        [
            x,
            e.ints("head/start", [-trailing]),
            e.ints("head/end", [np.iinfo(np.int64).max]),
            e.ints("head/axis", [1]),
        ],
        "head/trailing",
    )
    h = rms_norm(e, last, "output_norm.weight", "head/norm")
    t = m.tensor(m.output_tensor)
    raw = e.raw(t.name)
    pieces = row_chunks(m.vocab, m.hidden, e.chunk_values)
    outs = []
    for piece, (r0, r1) in enumerate(pieces):  # vocabulary pieces: one held at a time
        name = "output" if len(pieces) == 1 else f"output.{piece}"
        part = kernels.matmul(
            name, h, raw[r0:r1], t.type, r1 - r0, m.hidden, e.weights,
            accuracy_level=e.accuracy_level,
        )  # fmt: skip
        outs.append(e.part(part))
    logits = outs[0] if len(outs) == 1 else e.op("Concat", outs, "head/logits", axis=-1)
    if m.final_softcap is not None:
        c = e.floats("head/softcap", m.final_softcap)
        inner = e.op("Tanh", [e.op("Div", [logits, c], "head/capped_in")], "head/capped_t")
        logits = e.op("Mul", [inner, c], "head/capped")
    k = e.ints("head/k", [top_k])
    outs = ["trailing_top_logits", "trailing_top_ids"]
    e.nodes.append(
        helper.make_node("TopK", [logits, k], outs, "head/TopK", axis=-1, largest=1, sorted=1)
    )
    idx = e.op("Squeeze", [e.ints("head/last_v", [-1])], "head/last")
    top = e.op("Gather", [outs[0], idx], "top_logits", axis=1)
    ids = e.op("Gather", [outs[1], idx], "top_ids", axis=1)
    return top, ids, outs[0], outs[1]
