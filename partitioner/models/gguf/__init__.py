"""The GGUF segment builder: decoder segments straight from a GGUF file (issue 40).

- :mod:`.reader`          a lean GGUF reader: metadata, tensor infos, memory-mapped data
- :mod:`.header`          the file's header as a typed model; what is refused and why
- :mod:`.kernels`         GGUF tensors onto ONNX Runtime's CPU kernels, per tensor type
  (:mod:`.kernels_codes`, :mod:`.kernels_gather`, :mod:`.kernels_requant` behind it)
- :mod:`.archs`           the five architectures' layers as ONNX nodes
- :mod:`.ends`            the embedding and the output head (top-k), in row pieces
- :mod:`.builder`         one segment per block range, streamed to disk (the segment contract)
- :mod:`.heap`            the C heap's freed memory given back while a segment is built
- :mod:`.units`           the planner's unit table from the header alone
- :mod:`.reference`       a numpy forward for tests (llama.cpp semantics)

Small GGUF files for tests and benches: :mod:`devtools.gguf_files`.
"""
