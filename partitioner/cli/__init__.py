"""The partitioner's commands: ``fedshard split``, ``fedshard export`` and ``fedshard plan``.

Light to import (building the ``fedshard`` parser imports no onnx or torch); the top room of
the partitioner. The module list is the map in :mod:`partitioner`.
"""
