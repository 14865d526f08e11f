"""``fedshard.loraplan/1``: federated LoRA fine-tuning of a served model's trainable segments.

:attr:`LoraPlan.objective` says what is trained: ``causal-lm`` (a decoder, on text and chat
records) or ``contrastive`` (an encoder such as all-MiniLM-L6-v2, on ``{"anchor", "positive"}``
pairs, with in-batch negatives on the served model's mean-pooled sentence embedding).

The ServerApp sends a :class:`LoraPlan` as JSON under the fit-config key :data:`LORA_PLAN_KEY`.
The parameter arrays that travel are the adapters only, in :attr:`LoraPlan.adapters` order: for
every adapted linear layer its ``A`` (``[rank, in]``) and then its ``B`` (``[out, rank]``), so
``W' = W + (alpha / rank) · B · A`` in torch's ``[out, in]`` layout. The base weights never
travel: every device reads them from its own copy of the segments.

How a device finds them: :attr:`LoraPlan.weight_map` maps each torch parameter name of the
transformers definition (``model.layers.3.self_attn.q_proj.weight``) to the ONNX initializers
that hold it (:class:`WeightRef`: name, and whether the initializer is the transpose, as the
exporter folds ``x @ W.T`` into a ``MatMul`` with a ``[in, out]`` constant). Several references
are listed when the exporter shares one constant between equal weights (or ties the embedding
to the head); a device takes the one its segments have.

A device's text data (``fedshard agent --train-data DIR``): ``*.jsonl`` files with one record a
line, ``{"messages": [{"role", "content"}, ...]}`` (chat) or ``{"text": "..."}``, and ``*.txt``
files with one record a non-empty line. A record whose SHA-256 starts with a byte below
:data:`HELD_OUT_BYTE` is held out: it is evaluated on, never trained on.
"""

from __future__ import annotations

from typing import Final, Literal

import numpy as np
from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

from protocols.base import FrozenModel

LORA_PLAN_FORMAT: Final = "fedshard.loraplan/1"
LORA_PLAN_KEY: Final = "fedshard-lora-plan"
"""Fit-config key holding the :class:`LoraPlan` JSON."""
METRIC_EPSILON: Final = "epsilon"
"""Fit metric: the device's cumulative record-level epsilon for this run (RDP accountant),
rounded up to 2 significant digits (what leaves a device: :mod:`protocols.privacy`)."""
METRIC_HELD_OUT_LOSS: Final = "held-out-loss"
"""Fit metric (without DP only): mean token loss of the round's global model on the device's
held-out records (under DP with SecAgg+ it travels masked: :func:`stats_array`)."""
METRIC_HELD_OUT_TOKENS: Final = "held-out-tokens"
"""Fit metric: held-out tokens (decoders) or held-out pairs (encoders) behind the loss."""
METRIC_RECALL_AT_1: Final = "held-out-recall-at-1"
"""Fit/evaluate metric of encoders (without DP only): share of held-out anchors whose nearest
positive (cosine, over the device's whole held-out set) is their own (under DP with SecAgg+ it
travels masked: :func:`stats_array`)."""
METRIC_TRAINED_BYTES: Final = "trained-shard-bytes"
"""Fit metric: bytes of the base weights of the segments the device adapted."""
METRIC_PEAK_RSS: Final = "peak-rss-bytes"
"""Fit metric (without DP only): the training process's peak resident memory."""
HELD_OUT_BYTE: Final = 26
"""About 10 % of records (first SHA-256 byte < 26 of 256) are held out."""
DEFAULT_TARGETS: Final = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
ENCODER_TARGETS: Final = ("query", "key", "value", "dense")
"""BERT's attention projections and every dense layer (attention output, intermediate, output)."""
ENCODER_DEFAULT_TARGETS: Final = ("query", "value")
"""What an encoder adapts by default: under record-level DP, adapters on query and value only
kept MiniLM's held-out recall gain where all of :data:`ENCODER_TARGETS` lost it to the noise
(``bench/encoder_dp.py``)."""
Objective = Literal["causal-lm", "contrastive"]
MAX_REPLY_WEIGHT: Final = 1000
"""Most records one device's reply weighs in the average without DP (SecAgg+'s max_weight)."""
DP_REPLY_WEIGHT: Final = 1
"""Under record-level DP every device's reply weighs the same (its record count stays private)."""


ENCODER_METADATA_KEY: Final = "fedshard.encoder"
"""ONNX metadata key of a fedshard encoder export (``fedshard export minilm``): its value names
the encoder (:data:`MINILM_ENCODER`), from which a coordinator loads its torch definition."""
MINILM_ENCODER: Final = "all-minilm-l6-v2"


QuantScheme = Literal["linear", "matmul-nbits", "gather-block"]
"""How a quantized weight is stored (ONNX Runtime's formats, see :mod:`protocols.quant`)."""


class QuantRef(FrozenModel):
    """How the initializer of a :class:`WeightRef` stores its weight when it is quantized.

    - ``linear``: ``(q - zero_point) · scale`` (``quantize_dynamic``'s int8 ``MatMulInteger``
      weights, per channel along ``axis``, and ``DequantizeLinear`` tables, per tensor).
    - ``matmul-nbits``: ``MatMulNBits``' packed ``[N, blocks, blob]`` weight of ``bits`` bits,
      ``scale`` ``[N, blocks]`` and packed zero points, blocks of ``block_size`` along K.
    - ``gather-block``: ``GatherBlockQuantized``' ``[rows, cols]`` table, blocks of
      ``block_size`` along ``axis``.
    """

    scheme: QuantScheme
    scale: str = Field(min_length=1, max_length=512)
    zero_point: str | None = Field(default=None, min_length=1, max_length=512)
    axis: NonNegativeInt | None = None
    """``linear``: the per-channel axis (None: one scale for the tensor); ``gather-block``:
    the quantized axis."""
    bits: PositiveInt = 8
    """Bits per value: 4 or 8 (``matmul-nbits``, ``gather-block``); ``linear``: 8, or 7 for
    int8 data in ONNX Runtime's reduced range (``reduce_range``), re-quantized the same way."""
    block_size: PositiveInt | None = None
    symmetric: bool = True
    """The quantizer's mode (a merge re-quantizes the weight the same way)."""
    shape: list[PositiveInt] = Field(min_length=1, max_length=8)
    """The dequantized weight's shape, in the float initializer's layout (``MatMul``:
    ``[in, out]``)."""


class WeightRef(FrozenModel):
    """An ONNX initializer holding a torch parameter (or its transpose)."""

    initializer: str = Field(min_length=1, max_length=512)
    transpose: bool = False
    offset: float = 0.0
    """The initializer holds ``parameter + offset`` (Gemma's norms fold ``1 + weight``)."""
    quantized: QuantRef | None = None
    """Set when ``initializer`` holds the weight quantized (then the dequantized weight is the
    parameter, up to the quantization step)."""


class AdapterSpec(FrozenModel):
    """One adapted linear layer: its torch module name and its shape ``[out, in]``."""

    module: str = Field(min_length=1, max_length=512)
    """e.g. ``model.layers.3.self_attn.q_proj`` (its weight is ``module + ".weight"``)."""
    out_features: PositiveInt
    in_features: PositiveInt


class LoraSettings(FrozenModel):
    """Rank, scaling and which linear layers get adapters."""

    rank: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGETS), min_length=1)

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor of ``B · A`` in the merged weight."""
        return self.alpha / self.rank


class RecordDp(FrozenModel):
    """Record-level DP-SGD on each device (Opacus: per-example clipping, Gaussian noise)."""

    noise_multiplier: PositiveFloat = 1.0
    max_grad_norm: PositiveFloat = 1.0
    delta: PositiveFloat = 1e-5


class SegmentRef(FrozenModel):
    """A segment the plan relies on (hash-checked against the device's copy)."""

    index: NonNegativeInt
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class LoraPlan(FrozenModel):
    """What a round of federated LoRA trains and how."""

    format: Literal["fedshard.loraplan/1"] = LORA_PLAN_FORMAT
    run: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Run key: the device's privacy accountant composes the rounds of one run."""
    architecture: str = Field(min_length=1, max_length=128)
    """transformers class, e.g. ``LlamaForCausalLM`` (only known ones are built)."""
    config: str = Field(min_length=2, max_length=1 << 20)
    """The model's transformers config as JSON (data, never code)."""
    first_layer: NonNegativeInt
    """The first decoder layer that runs in torch; the segments before it run in ONNX Runtime."""
    boundary: str = Field(min_length=1, max_length=512)
    """The residual-stream tensor that feeds ``first_layer`` (an output of a frozen segment)."""
    segments: list[SegmentRef] = Field(min_length=1)
    """Every segment of the version, in order."""
    trainable: list[NonNegativeInt] = Field(min_length=1)
    """The segments whose layers get adapters (a suffix of the chain)."""
    weight_map: dict[str, list[WeightRef]]
    adapters: list[AdapterSpec] = Field(min_length=1)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    dp: RecordDp | None = None
    max_tokens: PositiveInt = Field(default=48, le=4096)
    """Records are cut to this many tokens."""
    local_epochs: PositiveInt = 1
    batch_size: PositiveInt = 16
    """Expected batch size (Poisson sampling under DP)."""
    learning_rate: PositiveFloat = 5e-3
    objective: Objective = "causal-lm"
    """``causal-lm`` for decoders, ``contrastive`` (in-batch negatives) for encoders."""
    contrastive_scale: PositiveFloat = 20.0
    """Contrastive objective: cosine similarities are multiplied by this before the softmax."""
    tokenizer_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of ``tokenizer.json`` in the device's segments directory."""

    @property
    def num_arrays(self) -> int:
        """How many arrays travel with each message (A and B per adapter)."""
        return 2 * len(self.adapters)


def reply_weight(plan: LoraPlan, records: int) -> int:
    """The FedAvg weight a device gives its adapters: :data:`DP_REPLY_WEIGHT` under DP, else its
    training records, capped at :data:`MAX_REPLY_WEIGHT`."""
    return DP_REPLY_WEIGHT if plan.dp is not None else min(records, MAX_REPLY_WEIGHT)


STATS_SCALE: Final = 16.0
"""Scale of the held-out loss in :func:`stats_array` (keeps losses up to 128 nats inside
SecAgg+'s clipping range [-8, 8])."""
STATS_SIZE: Final = 4
"""Length of the held-out statistics array (:func:`stats_array`)."""
EVALUATE_ONLY_KEY: Final = "fedshard-lora-evaluate-only"
"""Fit-config key set (True) on the round after a DP run's last one under SecAgg+: the device
trains nothing and replies with zero adapters and the held-out statistics of the global (final)
adapters, so the final evaluation also leaves only inside the SecAgg+ vector."""


def stats_array(loss: float, recall: float | None = None) -> np.ndarray:
    """A device's held-out statistics, appended to its reply under DP with SecAgg+: ``[loss /
    STATS_SCALE, 1, recall@1, 1]``, with ``[0, 0]`` in place of a measure the device lacks
    (no held-out records, a decoder's recall, a loss that is not finite). Inside the masked
    vector, so the coordinator sees only the round's sum and reads the devices' means
    (:func:`read_stats`), never one device's figure."""
    out = np.zeros(STATS_SIZE, np.float32)
    if np.isfinite(loss):
        out[0:2] = (loss / STATS_SCALE, 1.0)
    if recall is not None and np.isfinite(recall):
        out[2:4] = (recall, 1.0)
    return out


def read_stats(aggregate: np.ndarray) -> tuple[float | None, float | None]:
    """(mean held-out loss, mean recall@1) over the devices that had one, from the aggregate of
    their :func:`stats_array` (a sum or a mean: only ratios are read); None where none had."""
    values = [float(v) for v in np.asarray(aggregate, np.float64).reshape(-1)]
    if len(values) != STATS_SIZE:
        raise ValueError(f"held-out statistics of {len(values)} values, not {STATS_SIZE}")
    loss_sum, has_loss, recall_sum, has_recall = values
    loss = loss_sum / has_loss * STATS_SCALE if has_loss > 1e-6 else None
    recall = min(max(recall_sum / has_recall, 0.0), 1.0) if has_recall > 1e-6 else None
    return loss, recall


def carries_stats(plan: LoraPlan, secagg: bool) -> bool:
    """Whether a reply appends the held-out statistics array (DP rounds under SecAgg+ only: in
    clear it would give one device's loss away)."""
    return plan.dp is not None and secagg


def max_reply_weight(plan: LoraPlan) -> float:
    """SecAgg+'s ``max_weight`` for a plan: each device scales its vector by ``weight /
    max_weight`` before quantizing it to 2**22 levels over [-8, 8], so a maximum above what any
    reply weighs throws precision away (1000 for replies that weigh 1: a 4e-3 step on adapters)."""
    return float(DP_REPLY_WEIGHT if plan.dp is not None else MAX_REPLY_WEIGHT)
