"""Tests of the partitioner (``partitioner/``), one file per piece: graph analysis (frontier,
units, model I/O, roofline costs, decoders' KV state), the planner (exact plans, the requester,
scale, ``fedshard plan`` and ``--exact``), cutting (split end to end, its CLI, calibration, the
segment cache), the model front doors (MiniLM, decoders, the draft head, quantized decoders,
int8 rows, the Qwen source, LoRA over quantized weights), the GGUF kernels, and its rooms (map,
in-function imports).

The shared helpers live in ``tests/`` (on ``sys.path`` through ``tests/conftest.py``):
``graph_helpers`` (hand-built ONNX graphs, tiny decoders).
"""
