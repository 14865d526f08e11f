"""Model front doors: turn a packaged PyTorch / Hugging Face model into an ONNX file.

Each front door writes one ONNX file with real weights and dynamic batch and sequence axes, and
embeds real sample inputs (tokenizer output) in the model's metadata so that
``fedshard split --verify`` compares on real data. torch and transformers are imported only
inside the functions: importing this module is cheap. Nothing is downloaded
(``HF_HUB_OFFLINE=1``).

Decoders (``gemma3-270m``, ``tiny-gemma3``, ``tiny-llama``) write a directory instead of one
file (:mod:`protocols.decoder`); their code lives in :mod:`partitioner.models.decoders`.

Adding a model: write ``export_<name>(out, **options) -> ExportResult`` and register it in
:data:`FRONT_DOORS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.errors import GraphError
from partitioner.models.decoders.cache import cached_dir, default_cache_dir
from partitioner.models.decoders.export import export_decoder as export_source
from partitioner.models.decoders.export import state_names
from partitioner.models.decoders.progress import Steps
from partitioner.models.decoders.quality import (
    QUALITY_TOKENS,
    Quality,
    compare_decoders,
    write_summary,
)
from partitioner.models.decoders.sources import DECODER_NAMES, load_source
from partitioner.models.decoders.weights import Weights
from partitioner.models.packaged import minilm_dir, offline
from protocols.lora import ENCODER_METADATA_KEY, MINILM_ENCODER

if TYPE_CHECKING:
    from partitioner.models.decoders.precision import Report

DEFAULT_SENTENCES = (
    "The partitioner cuts one network across the devices of a local network.",
    "Each device runs its own segment and hands activations to the next.",
    "A short one.",
)


@dataclass(frozen=True)
class ExportResult:
    """An exported model and how closely ONNX Runtime reproduces the PyTorch model."""

    path: Path
    outputs: tuple[str, ...]
    max_abs_diff: float
    """Largest difference between ONNX Runtime and PyTorch on the embedded samples."""
    param_bytes: int
    precision: Report | None = None
    """Decoders stored in another precision than float32: sizes before and after."""
    quality: Quality | None = None
    """... and how they score against float32 on real text."""


def export_minilm(
    out: Path, *, pooled: bool = False, sentences: Sequence[str] = DEFAULT_SENTENCES
) -> ExportResult:
    """Export all-MiniLM-L6-v2 (real weights) to ``out`` with dynamic batch and sequence axes.

    Inputs: ``input_ids``, ``attention_mask``, ``token_type_ids`` (int64, ``[batch, sequence]``).
    Outputs: ``last_hidden_state`` and, with ``pooled``, ``sentence_embedding`` (mean pooling
    over the mask, L2-normalised, as sentence-transformers does).
    """
    offline()
    import torch
    from transformers import AutoModel, AutoTokenizer

    directory = minilm_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModel.from_pretrained(directory).eval()
    encoded = tokenizer(list(sentences), padding=True, return_tensors="pt")
    names = ("input_ids", "attention_mask", "token_type_ids")
    args = tuple(encoded[n].to(torch.int64) for n in names)
    wrapper = _encoder_module(model, pooled)
    outputs = ("last_hidden_state", "sentence_embedding") if pooled else ("last_hidden_state",)
    return _export(wrapper, args, names, outputs, out, {ENCODER_METADATA_KEY: MINILM_ENCODER})


def _encoder_module(model: Any, pooled: bool) -> Any:
    """A ``torch.nn.Module`` taking the three BERT inputs positionally (torch imported here)."""
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            hidden = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
            ).last_hidden_state
            if not pooled:
                return hidden
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return hidden, torch.nn.functional.normalize(summed, p=2.0, dim=1)

    return Encoder().eval()


def _export(
    module: Any,
    args: tuple[Any, ...],
    input_names: Sequence[str],
    output_names: Sequence[str],
    out: Path,
    metadata: Mapping[str, str] | None = None,
) -> ExportResult:
    """Export with the dynamo exporter, embed the samples (and ``metadata``), check against
    PyTorch."""
    import onnx
    import torch

    # heavy: keeps onnx off a light import
    from partitioner.analysis.modelio import initializer_bytes, save_model

    # heavy: keeps onnx off a light import
    from partitioner.analysis.samples import SAMPLE_INPUTS_KEY, encode_samples

    # heavy: keeps onnx off a light import
    from partitioner.cutting.verify import compare, run_model

    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    dynamic = {n: {0: batch, 1: sequence} for n in input_names}
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_shapes=dynamic,
            verbose=False,
        )
        expected = module(*args)
    if program is None:
        raise GraphError("torch.onnx.export returned no program")
    model: onnx.ModelProto = program.model_proto
    samples = {n: a.numpy() for n, a in zip(input_names, args, strict=True)}
    entry = model.metadata_props.add()
    entry.key, entry.value = SAMPLE_INPUTS_KEY, encode_samples(samples)
    for key, value in (metadata or {}).items():
        prop = model.metadata_props.add()
        prop.key, prop.value = key, value
    save_model(model, out)
    reference = expected if isinstance(expected, tuple) else (expected,)
    want = {n: t.numpy() for n, t in zip(output_names, reference, strict=True)}
    diff = max(compare(want, run_model(out, samples)).values())
    return ExportResult(out, tuple(output_names), diff, initializer_bytes(model))


def export_decoder(
    name: str,
    out_dir: Path,
    *,
    top_k: int = 64,
    cache_dir: Path | None = None,
    steps: Steps | None = None,
    weights: Weights | None = None,
    score: bool = True,
    draft_vocabulary: int | None = None,
) -> ExportResult:
    """Export decoder ``name`` to the directory ``out_dir`` (``model.onnx``, ``decoder.json``,
    tokenizer files); ``result.path`` is the ``model.onnx`` file.

    ``draft_vocabulary`` makes a draft-only export instead (a draft model for speculative
    decoding, never served: :mod:`partitioner.models.decoders.draft_head`), its output head cut to
    that many tokens; ``weights`` and ``score`` do not apply to it.

    ``weights`` (default: the model's,
    :func:`partitioner.models.decoders.precision.default_weights`) stores the weights in fp32, fp16,
    int8 or int4 with ONNX Runtime's tools: the float32 export is kept in ``cache_dir`` and
    converted, and unless ``score`` is false the result is scored against it on real text
    (``result.quality``; also written to ``out_dir/precision.json``). ``cache_dir`` keeps converted
    checkpoints and float32 exports between runs (default ``~/.cache/fedshard``; the CLI passes
    ``$FEDSHARD_CACHE`` when set); ``steps`` reports the slow steps.
    """
    # heavy: keeps onnx off a light import
    from partitioner.models.decoders.precision import default_weights

    steps = steps or Steps()
    cache = cache_dir or default_cache_dir(None)
    weights = weights or default_weights(name)
    if draft_vocabulary is not None:
        return _draft_decoder(name, out_dir, top_k, cache, steps, draft_vocabulary)
    if weights != "fp32":
        return _quantized_decoder(name, out_dir, top_k, cache, steps, weights, score)

    source = load_source(name, cache, steps)
    done = export_source(source, out_dir, top_k=top_k, steps=steps, release_weights=True)
    outputs = tuple(state_names(done.info)[1])
    return ExportResult(done.model_path, outputs, done.max_abs_diff, done.param_bytes)


def _quantized_decoder(
    name: str, out_dir: Path, top_k: int, cache: Path, steps: Steps, weights: Weights, score: bool
) -> ExportResult:
    """The float32 export (cached), converted to ``weights`` in ``out_dir`` and scored."""
    # heavy: keeps onnx off a light import
    from partitioner.models.decoders.precision import quantize_decoder

    fp32 = float32_export(name, cache, top_k, steps)
    report = quantize_decoder(fp32, out_dir, weights, steps=steps)
    quality = None
    if score:
        with steps.step(f"scoring {weights} against fp32 on {QUALITY_TOKENS} tokens of text"):
            quality = compare_decoders(fp32, out_dir)
        write_summary(out_dir, report, quality)
    outputs = ("top_logits", "top_ids", *_state_outputs(out_dir))
    diff = float((fp32 / _TORCH_DIFF_FILE).read_text())
    return ExportResult(out_dir / "model.onnx", outputs, diff, report.weight_bytes, report, quality)


def _draft_decoder(
    name: str, out_dir: Path, top_k: int, cache: Path, steps: Steps, vocabulary: int
) -> ExportResult:
    """The float32 export (cached), written to ``out_dir`` as a draft-only export."""
    # heavy: keeps onnx off a light import
    from partitioner.models.decoders.draft_head import write_draft_decoder

    fp32 = float32_export(name, cache, top_k, steps)
    report = write_draft_decoder(fp32, out_dir, vocabulary=vocabulary, steps=steps)
    outputs = ("top_logits", "top_ids", *_state_outputs(out_dir))
    diff = float((fp32 / _TORCH_DIFF_FILE).read_text())
    return ExportResult(out_dir / "model.onnx", outputs, diff, report.weight_bytes, report)


def float32_export(name: str, cache: Path, top_k: int = 64, steps: Steps | None = None) -> Path:
    """The float32 export of decoder ``name`` kept in ``cache`` (made once): what every other
    precision is converted from and scored against."""

    def build(tmp: Path) -> None:
        result = export_decoder(
            name, tmp, top_k=top_k, cache_dir=cache, steps=steps, weights="fp32"
        )
        (tmp / _TORCH_DIFF_FILE).write_text(f"{result.max_abs_diff!r}\n")

    # "-trailing": exports from before the graph returned the trailing positions' candidates
    # (speculative decoding) are not reused
    return cached_dir(cache / "exports" / f"{name}-top{top_k}-trailing-fp32", build)


_TORCH_DIFF_FILE = ".torch-check"
"""In a cached float32 export: ONNX Runtime's max abs diff against torch when it was made."""


def _state_outputs(out_dir: Path) -> list[str]:
    """The export's outputs after ``top_logits``/``top_ids``: the trailing candidates (when the
    export has them) and every layer's present keys and values."""
    from protocols.decoder import (
        DECODER_FILE,
        TRAILING_TOP_IDS,
        TRAILING_TOP_LOGITS,
        DecoderInfo,
    )

    info = DecoderInfo.from_json((out_dir / DECODER_FILE).read_text())
    trailing = [TRAILING_TOP_LOGITS, TRAILING_TOP_IDS] if info.trailing_positions else []
    return [*trailing, *(pair.present for pair in info.state)]


FRONT_DOORS: dict[str, Callable[..., ExportResult]] = {
    "minilm": export_minilm,
    **{name: partial(export_decoder, name) for name in DECODER_NAMES},
}
"""Front doors by name, as ``fedshard export NAME`` offers them."""
