"""The models room: packaged models into ONNX, and graph work on them.

Front doors (torch/Hugging Face to ONNX), the decoders (:mod:`partitioner.models.decoders`),
LoRA on exported graphs, and the GGUF segment builder (:mod:`partitioner.models.gguf`). torch,
transformers and onnx are imported inside functions where a light import needs it (each such
import says so). The module list is the map in :mod:`partitioner`.
"""
