"""A deploy from a GGUF file: planned from its header, each stage's segment built from the file.

No whole-model graph is ever built or written. In turn:

1. the header is read (:func:`header_of`; what the builder cannot serve is refused here, before
   anything is built or pushed, as a typed 400);
2. the tokenizer (``tokenizer.json``) and a :class:`~protocols.decoder.DecoderInfo`
   (``decoder.json``, the chat template from ``tokenizer.chat_template`` or
   :data:`FALLBACK_CHAT_TEMPLATE`) are written into the version's directory, which becomes the
   model's tokenizer directory;
3. the unit table (:mod:`coordinator.deploy.gguf_plan`) is planned with the planner as it is;
4. each stage's segment is written by the builder (weights streamed to a data file), run here
   in ONNX Runtime on the health check's prompt (its outputs feed the next stage), probed with
   the same session for speculative decoding (a pass of ``k`` tokens against ``k`` one-token
   steps, bit for bit; the verdict goes into ``decoder.json`` as ``rows_probed`` and
   ``rows_independent``, so verification runs only where it holds), released before the next
   segment is built, then joined into the one file an agent receives
   (:mod:`coordinator.deploy.gguf_stages`), so the process holds about one segment;
5. the manifest is written (:mod:`coordinator.deploy.gguf_manifest`), and the peak resident
   memory of the whole stretch is measured (:class:`~coordinator.deploy.peak_memory.PeakMemory`)
   and logged next to the file size and the largest segment, and kept on the version's
   :class:`~protocols.gguf_card.GgufCard`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.deploy.cutting import Arrays, DeployCommand, SplitOutcome, baseline_planner
from coordinator.deploy.gguf_manifest import gguf_manifest
from coordinator.deploy.gguf_plan import GgufUnits, planning_problem, unit_table
from coordinator.deploy.gguf_stages import build_stages
from coordinator.deploy.gguf_tokenizer import GgufVocabulary, build_tokenizer, read_vocabulary
from coordinator.deploy.limits import planned_limits
from coordinator.deploy.peak_memory import PeakMemory
from coordinator.errors import (
    DeployError,
    NoFitError,
    UnsupportedArchitectureError,
    UnsupportedModelError,
    UnsupportedRopeScalingError,
    UnsupportedTensorTypeError,
)
from coordinator.generation.feeds import step_inputs
from partitioner.analysis.decoding import describe_state
from partitioner.errors import InfeasiblePlanError
from partitioner.models.gguf.builder import DEFAULT_TOP_K, GgufSource
from partitioner.models.gguf.header import GgufModel, UnsupportedModel, read_header
from partitioner.models.gguf.heap import release_freed_heap
from partitioner.models.gguf.kernels import MATMUL_BITS, UnsupportedTensorType
from partitioner.models.gguf.rows import RowsProbe
from partitioner.planning.planner import plan_preferring_one_device
from protocols.decoder import (
    DECODER_FILE,
    TOKENIZER_FILE,
    TRAILING_POSITIONS,
    DecoderInfo,
    StatePair,
    past_name,
    present_name,
)
from protocols.gguf_card import GgufBuild, GgufCard, WeightsMode
from protocols.manifest import DEFAULT_SESSIONS, SessionLimits
from protocols.plan import Plan
from protocols.problem import PlanningProblem

log = logging.getLogger(__name__)

FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
"""The chat template of a GGUF file that carries none (``tokenizer.chat_template`` absent): each
message as ``role: content`` on its own line, then ``assistant:``. Plain text any base model
continues; a file with its own template always uses that."""
HEALTH_PROMPT = "The devices of a local network"
"""The health check's prompt (encoded with the file's tokenizer)."""


def header_of(path: Path) -> GgufModel:
    """The GGUF file's header; what the builder cannot serve raises the matching
    :class:`~coordinator.errors.UnsupportedModelError` (HTTP 400 with a code naming it)."""
    with refusals(path):
        try:
            return read_header(path)
        except (OSError, ValueError) as exc:  # gguf-py raises ValueError for a bad file
            raise DeployError(f"cannot read the GGUF file {path}: {exc}") from exc


@contextmanager
def refusals(path: Path) -> Iterator[None]:
    """Turns the builder's refusals (``UnsupportedModel``, ``UnsupportedTensorType``) into the
    coordinator's typed ones."""
    try:
        yield
    except UnsupportedModel as exc:
        raise _refusal(exc.reason, exc.detail, f"{path.name}: {exc}") from exc
    except UnsupportedTensorType as exc:
        raise UnsupportedTensorTypeError(f"{path.name}: {exc}", str(exc)) from exc


def _refusal(reason: str, detail: str, message: str) -> UnsupportedModelError:
    kinds: dict[str, type[UnsupportedModelError]] = {
        "architecture": UnsupportedArchitectureError,
        "tensor_type": UnsupportedTensorTypeError,
        "rope_scaling": UnsupportedRopeScalingError,
    }
    return kinds.get(reason, UnsupportedModelError)(message, detail)


def gguf_split_and_run(
    command: DeployCommand,
    devices: Any,
    out: Path,
    work_scales: Sequence[float] | None = None,
) -> SplitOutcome:
    """Plan ``command.model_path`` (a GGUF file) on ``devices``, build its segments into
    ``out`` and run them here on the health check's prompt (module docstring)."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    with PeakMemory() as peak:
        model = header_of(command.model_path)
        with refusals(command.model_path):
            vocab = read_vocabulary(command.model_path)
            encoded = _write_tokenizer(vocab, out / TOKENIZER_FILE)
            release_freed_heap()  # the tokenizer's build freed hundreds of MB (Gemma 3)
            info = decoder_info(model, vocab, command.model_id, command.weights)
            (out / DECODER_FILE).write_text(info.to_json() + "\n")
            sessions = DEFAULT_SESSIONS
            table = unit_table(model, sessions, command.weights)
            problem = planning_problem(table, devices, command.model_id, work_scales)
            plan = _plan(command, problem, table, sessions)
            wire, local = health_feeds(model, _prompt(encoded, info))
            built = build_stages(_open(command.model_path), plan, out, local, command.weights)
            info = probed(info, built.probe)
            (out / DECODER_FILE).write_text(info.to_json() + "\n")
        manifest = gguf_manifest(command.model_path, plan, problem, table, built, sessions)
        (out / "manifest.json").write_text(manifest.to_json() + "\n")
    known = built.known
    state = {n for s in manifest.segments for p in s.state for n in (p.past, p.present)}
    expected = {o.name: known[o.name] for o in manifest.model.outputs if o.name not in state}
    sizes = [(out / s.file).stat().st_size for s in manifest.segments]
    build = GgufBuild(
        peak_rss_bytes=peak.bytes,
        largest_segment_bytes=max(sizes),
        segment_bytes=sum(sizes),
        seconds=time.monotonic() - started,
    )
    card = model_card(model, command.model_path, command.weights, build)
    log.info(
        "%s: built %d segments from %s (%.1f MB); largest segment %.1f MB; peak resident "
        "memory %.1f MB%s",
        command.model_id,
        len(sizes),
        command.model_path.name,
        card.file_bytes / 1e6,
        build.largest_segment_bytes / 1e6,
        build.peak_rss_bytes / 1e6,
        "" if peak.reset else " (process lifetime peak)",
    )
    return SplitOutcome(
        manifest,
        out,
        wire,
        built.warmups,
        expected,
        planned_limits(manifest, {}),
        table.work,
        tokenizer_dir=out,
        card=card,
    )


def _open(path: Path) -> GgufSource:
    with refusals(path):
        try:
            return GgufSource(path)
        except (OSError, ValueError) as exc:  # gguf-py raises ValueError for a bad file
            raise DeployError(f"cannot read the GGUF file {path}: {exc}") from exc


def probed(info: DecoderInfo, probe: RowsProbe) -> DecoderInfo:
    """``info`` recording the rows probe's verdict on the built chain (``rows_probed``,
    ``rows_independent``): speculative verification runs only where it found a pass of several
    tokens decoding as one-token steps, bit for bit."""
    return info.model_copy(update={"rows_probed": True, "rows_independent": probe.alike})


def _plan(
    command: DeployCommand, problem: PlanningProblem, table: GgufUnits, sessions: SessionLimits
) -> Plan:
    choose = (
        plan_preferring_one_device
        if command.baseline is None
        else baseline_planner(command.baseline)
    )
    try:
        return choose(problem, command.objective)
    except InfeasiblePlanError as exc:
        kv = describe_state(sum(table.state_bytes), sessions)
        raise NoFitError(f"cannot plan {command.model_path.name}: {exc}; {kv}") from exc


def decoder_info(
    model: GgufModel, vocab: GgufVocabulary, model_id: str, weights: WeightsMode = "keep"
) -> DecoderInfo:
    """The ``decoder.json`` of a GGUF model: its shapes, special tokens and chat template.

    A model with any ``MatMulNBits`` product (``int4``, ``int8``, or a kept quantized tensor:
    4-bit, or widened to 8) says ``int4``, so speculative verification runs only where every
    agent computes a 4-bit product's row alike alone and in a pass (the rule exported int4
    decoders follow; the deploy's rows probe ran on the coordinator's CPU, and ONNX Runtime's
    AVX2 kernels run a lone row through a kernel of their own). No agent measures 8-bit
    ``MatMulNBits`` apart, so it is held to their 4-bit verdict (the cautious side: a wrong
    verdict would change greedy text, a cautious one only its speed). Only a file of float
    weights says ``None``."""
    bos = model.bos_token_id if vocab.add_bos else None
    return DecoderInfo(
        model=model_id,
        architecture=f"gguf:{model.architecture.value}",
        num_layers=model.layers,
        hidden_size=model.hidden,
        num_kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        vocab_size=model.vocab,
        top_k=min(DEFAULT_TOP_K, model.vocab),
        max_context=model.context_length,
        sliding_window=model.sliding_window,
        bos_token_id=bos,
        eos_token_ids=list(model.eos_token_ids),
        chat_template=model.chat_template or FALLBACK_CHAT_TEMPLATE,
        state=[
            StatePair(past=past_name(i, kind), present=present_name(i, kind))
            for i in range(model.layers)
            for kind in ("key", "value")
        ],
        trailing_positions=TRAILING_POSITIONS,
        weights="int4" if _nbits_products(model, weights) else None,
        rows_independent=True,
    )


def _nbits_products(model: GgufModel, weights: WeightsMode) -> bool:
    """Whether some weight product of ``model`` at ``weights`` runs as ``MatMulNBits``."""
    if weights != "keep":
        return True
    return any(t.type in MATMUL_BITS for t in model.tensors.values() if len(t.shape) == 2)


def _write_tokenizer(vocab: GgufVocabulary, out: Path) -> list[int]:
    """Write ``vocab``'s ``tokenizer.json`` to ``out``; the health prompt's ids, encoded by the
    same tokenizer object (loading the file again took about 260 MB more for Gemma 3)."""
    tokenizer = build_tokenizer(vocab)
    tokenizer.save(str(out))
    ids: list[int] = tokenizer.encode(HEALTH_PROMPT, add_special_tokens=False).ids
    return ids


def _prompt(encoded: list[int], info: DecoderInfo) -> list[int]:
    """The health check's prompt as token ids (BOS first where the model adds one)."""
    ids = [i for i in encoded if i < info.vocab_size][:16] or [0]
    return ([info.bos_token_id] if info.bos_token_id is not None else []) + ids


def health_feeds(model: GgufModel, prompt: Sequence[int]) -> tuple[Arrays, Arrays]:
    """The one-shot prefill of ``prompt`` sent through the chain, and the same with empty
    caches for every block (the local run)."""
    wire = step_inputs(0, list(prompt))
    local = dict(wire)
    empty = np.zeros((1, model.kv_heads, 0, model.head_dim), dtype=np.float32)
    for i in range(model.layers):
        local[past_name(i, "key")] = empty
        local[past_name(i, "value")] = empty
    return wire, local


def model_card(
    model: GgufModel, path: Path, weights: WeightsMode, build: GgufBuild | None = None
) -> GgufCard:
    """What ``GET /v1/models`` and the console show of a deployed GGUF file."""
    mix: dict[str, int] = {}
    for tensor in model.tensors.values():
        mix[tensor.ggml_type] = mix.get(tensor.ggml_type, 0) + tensor.elements
    return GgufCard(
        file=path.name,
        file_bytes=path.stat().st_size,
        name=model.name,
        architecture=model.architecture.value,
        parameters=model.parameters,
        layers=model.layers,
        quantization=dict(sorted(mix.items(), key=lambda kv: -kv[1])),
        weights=weights,
        build=build,
    )
