"""The stages of a GGUF deploy, built, run and probed one segment at a time.

For each stage of the plan in turn (:func:`build_stages`): its segment is written by the builder
(weights streamed to a data file), loaded into one ONNX Runtime session here, run on the health
check's prompt (its outputs feed the next stage), probed for speculative decoding with the same
session (:class:`~partitioner.models.gguf.rows.RowsProbe`: a pass of ``k`` tokens against ``k``
one-token steps, bit for bit), released, and joined into the one file an agent receives
(:mod:`coordinator.deploy.onnx_inline`). So the process holds about one segment, and the probe
costs a session no more than the health run did: per window of the probe (three: after the
prompt and short of 64 and of 128 tokens) ``2 x 8 - 1`` short runs of each stage.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from coordinator.deploy.cutting import Arrays
from coordinator.deploy.gguf_plan import stage_ranges
from coordinator.deploy.onnx_inline import inline_external_data
from coordinator.errors import DeployError
from partitioner.models.gguf.builder import GgufSource, write_segment
from partitioner.models.gguf.heap import release_freed_heap
from partitioner.models.gguf.rows import RowsProbe
from protocols.decoder import INPUT_IDS
from protocols.gguf_card import WeightsMode
from protocols.manifest import TensorInfo
from protocols.plan import Plan

log = logging.getLogger(__name__)

SCRATCH_SUFFIX = ".build"


class Built:
    """The stages as built: per segment its file, inputs, outputs and declared types, and the
    rows probe's verdict on the chain."""

    def __init__(self, known: Arrays, probe: RowsProbe) -> None:
        self.known: Arrays = dict(known)
        self.files: list[Path] = []
        self.inputs: list[list[str]] = []
        self.outputs: list[list[str]] = []
        self.warmups: list[Arrays] = []
        self.param_bytes: list[int] = []
        self.declared: dict[str, TensorInfo] = {}
        self.probe = probe


def _session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class _Runner:
    """One segment's session, run by input name (every declared input) to all its outputs."""

    def __init__(self, path: Path) -> None:
        self.session = _session(path)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> Arrays:
        values = self.session.run(self.outputs, {n: feeds[n] for n in self.inputs})
        return {n: np.asarray(v) for n, v in zip(self.outputs, values, strict=True)}


def build_stages(
    source: GgufSource, plan: Plan, out: Path, local: Arrays, weights: WeightsMode
) -> Built:
    """Write, run, probe and join each stage's segment in turn (module docstring).

    ``source`` is the file, mapped once; the builder gives each weight's mapped pages back once
    mapped (they would otherwise count as this process's resident memory for the whole build).
    ``local`` is the health check's prefill with empty caches for every block."""
    path = source.path
    probe = RowsProbe(
        prompt_length=int(local[INPUT_IDS].shape[1]),
        vocab=source.model.vocab,
        max_context=source.model.context_length,
    )
    built = Built(local, probe)
    for k, span in enumerate(stage_ranges(plan, source.model)):
        scratch = out / f"segment{k}{SCRATCH_SUFFIX}.onnx"
        files = write_segment(scratch, source, span, weights=weights)
        release_freed_heap()
        graph = onnx.load(str(scratch), load_external_data=False).graph
        inputs = [i.name for i in graph.input]
        outputs = [o.name for o in graph.output]
        for value in [*graph.input, *graph.output]:
            built.declared.setdefault(value.name, _tensor_info(value))
        try:
            built.warmups.append({n: built.known[n] for n in inputs})
            run = _Runner(scratch)
            built.known.update(run(built.known))
            probe.stage(run, inputs, built.known)
            del run
            release_freed_heap()
        except (KeyError, ValueError, RuntimeError) as exc:  # ONNX Runtime's failures
            raise DeployError(f"segment {k} of {path.name} does not run: {exc}") from exc
        final = out / f"segment{k}.onnx"
        inline_external_data(scratch, final)
        release_freed_heap()
        built.param_bytes.append(sum(f.stat().st_size for f in files[1:]))
        for file in files:
            file.unlink(missing_ok=True)
        built.files.append(final)
        built.inputs.append(inputs)
        built.outputs.append(outputs)
    if not probe.alike:
        log.warning(
            "%s: a pass of several tokens does not decode as one-token steps here (%s): "
            "speculative decoding stays off",
            path.name,
            probe.difference,
        )
    return built


def _tensor_info(value: onnx.ValueInfoProto) -> TensorInfo:
    tt = value.type.tensor_type
    dtype = str(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
    shape: list[int | str | None] = [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
    ]
    return TensorInfo(name=value.name, dtype=dtype, shape=shape)
