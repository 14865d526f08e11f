"""``fedshard.decoder/1``: how a decoder (text-generation) model's ONNX graph is laid out.

``fedshard export NAME OUT_DIR`` writes, for a decoder model::

    OUT_DIR/model.onnx          the whole model, with explicit key/value state
    OUT_DIR/decoder.json        a DecoderInfo document (this module)
    OUT_DIR/tokenizer.json      the model package's tokenizer (Hugging Face ``tokenizers`` format)
    OUT_DIR/tokenizer_config.json, special_tokens_map.json, ... whatever the package ships

The graph's contract, with no padding. Every tensor's first axis is ``batch``: independent
sequences of equal length. A session is one sequence (batch 1); a stage that keeps no state may
run several sessions' steps together along that axis.

Inputs
    ``input_ids`` int64 ``[batch, q]``: the new tokens of this step (the prompt on prefill, one
    token on decode). ``attention_mask`` int64 ``[batch, past + q]``: all ones. ``position_ids``
    int64 ``[batch, q]``: ``past .. past + q - 1``. ``past.{i}.key`` / ``past.{i}.value`` float32
    ``[batch, kv_heads, past, head_dim]`` for every layer ``i`` (``past = 0`` on the first step).
    Masks and rotary embeddings are computed in the graph from ``attention_mask`` and
    ``position_ids`` only (never from the shapes of the past tensors), so any stage can rebuild
    them from those two small inputs.
Outputs
    ``top_logits`` float32 ``[batch, top_k]`` and ``top_ids`` int64 ``[batch, top_k]``: the largest
    next-token logits of the last position, in descending order (greedy decoding takes
    ``top_ids[0, 0]``). ``present.{i}.key`` / ``present.{i}.value``: the past grown by ``q``
    along axis 2 (every layer keeps the full context; sliding-window layers mask instead of
    truncating).
    ``trailing_top_logits`` float32 / ``trailing_top_ids`` int64 ``[batch, min(q, W), top_k]``
    (graphs whose DecoderInfo sets ``trailing_positions = W``): the same top-k for each of the
    step's last ``min(q, W)`` positions, oldest first, so one pass can verify several drafted
    tokens (speculative decoding). ``top_logits`` equals ``trailing_top_logits[:, -1]``.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, NonNegativeInt, PositiveInt

from protocols.base import FrozenModel

DECODER_FORMAT: Final = "fedshard.decoder/1"
DECODER_FILE: Final = "decoder.json"
MODEL_FILE: Final = "model.onnx"
TOKENIZER_FILE: Final = "tokenizer.json"
DECODER_METADATA_KEY: Final = "fedshard.decoder"
"""ONNX ``metadata_props`` key under which ``model.onnx`` carries its DecoderInfo JSON."""

INPUT_IDS: Final = "input_ids"
ATTENTION_MASK: Final = "attention_mask"
POSITION_IDS: Final = "position_ids"
TOP_LOGITS: Final = "top_logits"
TOP_IDS: Final = "top_ids"
TRAILING_TOP_LOGITS: Final = "trailing_top_logits"
TRAILING_TOP_IDS: Final = "trailing_top_ids"
TRAILING_POSITIONS: Final = 8
"""Trailing positions whose top-k the exported graphs return (so up to 7 drafted tokens are
verified per pass; a prefill pays for this many positions of the output head, not one)."""
KV_AXIS: Final = 2
"""The sequence axis of every key/value tensor."""


def past_name(layer: int, kind: Literal["key", "value"]) -> str:
    """Graph input holding layer ``layer``'s cached keys or values."""
    return f"past.{layer}.{kind}"


def present_name(layer: int, kind: Literal["key", "value"]) -> str:
    """Graph output holding layer ``layer``'s keys or values after this step."""
    return f"present.{layer}.{kind}"


class StatePair(FrozenModel):
    """A graph input fed back from a graph output on the next step (a layer's KV cache)."""

    past: str = Field(min_length=1, max_length=512)
    present: str = Field(min_length=1, max_length=512)
    axis: NonNegativeInt = KV_AXIS
    """The axis the state grows along, one entry per token."""


class DecoderInfo(FrozenModel):
    """``decoder.json``: what the coordinator and the partitioner need to know of a decoder."""

    format: Literal["fedshard.decoder/1"] = DECODER_FORMAT
    model: str = Field(min_length=1, max_length=128)
    """Front-door name, e.g. ``gemma3-270m``."""
    architecture: str = Field(min_length=1, max_length=128)
    """The transformers class the weights came from, e.g. ``Gemma3ForCausalLM``."""
    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    vocab_size: PositiveInt
    top_k: PositiveInt
    """How many next-token candidates the graph returns."""
    max_context: PositiveInt
    """Longest context (prompt plus generated tokens) the model supports."""
    sliding_window: PositiveInt | None = None
    bos_token_id: NonNegativeInt | None = None
    eos_token_ids: list[NonNegativeInt] = Field(default_factory=list, max_length=64)
    chat_template: str | None = Field(default=None, max_length=1 << 20)
    """Jinja chat template from the model package (rendered in a sandbox)."""
    state: list[StatePair] = Field(min_length=1)
    trailing_positions: PositiveInt | None = None
    """How many trailing positions' top-k the graph returns in ``trailing_top_logits`` /
    ``trailing_top_ids``; None for graphs exported without them (no speculative decoding)."""
    weights: Literal["fp32", "fp16", "int8", "int4"] | None = None
    """The precision the graph's weights are stored in (None: float32, or an export made before
    the precision was recorded here). int4 graphs compute a row alike alone and in a pass only
    on CPUs whose 4-bit kernel does
    (:attr:`~protocols.profile.DeviceProfile.int4_rows_exact`)."""
    rows_independent: bool = True
    """Whether a position's outputs do not depend on the other positions run in the same pass.
    False for ``quantize_dynamic``'s int8, whose ``DynamicQuantizeLinear`` picks one
    activation scale for the whole pass, and for int4 exported on a CPU whose ONNX Runtime
    kernel runs one row through another kernel than several (AVX2; the export checks):
    verifying k drafted tokens in one pass would then not give the tokens one-at-a-time
    decoding gives, so speculative decoding is off."""
    rows_probed: bool = False
    """Whether the export measured ``rows_independent`` on the machine that made it: passes of
    every length up to ``trailing_positions`` gave each token's candidates and keys and values
    bit for bit as one-token steps did. False in exports made before every precision was
    probed (float32 and float16 ones were not: their one-row products differ in the last bits
    from a pass's), and in graphs built without the check; the coordinator then speculates only
    on int8 and int4 graphs, which were checked before this field was recorded."""

    draft_vocabulary: PositiveInt | None = None
    """Set on a draft-only export (``fedshard export --draft``): its output head scores only
    this many of the ``vocab_size`` tokens, so it may propose drafts but must not be served."""

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of key/value cache one token adds across all layers (float32)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
