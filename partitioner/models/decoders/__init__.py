"""Decoder (text-generation) front doors: export to the ``fedshard.decoder/1`` layout.

Modules: :mod:`.sources` (which models, loaded with torch), :mod:`.wrapper` (the exported
module: explicit KV, masks from ``attention_mask`` and ``position_ids``), :mod:`.export`
(ONNX, ``decoder.json``, tokenizer, checks), :mod:`.ort_runner` (one-session greedy baseline),
:mod:`.reference` (transformers' greedy ``generate``), :mod:`.gemma` and :mod:`.tiny` (the
models), :mod:`.cache` (converted checkpoints), :mod:`.precision` (the stored weight precision)
over :mod:`.ort_quantizers` (ONNX Runtime's quantizers as the export runs them). torch and
transformers are imported only inside functions.
"""
