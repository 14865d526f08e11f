"""The analysis room: what an ONNX graph is and costs, before any plan.

Graph structure, execution order and cut frontiers, shapes, planning units and their costs
(FLOPs, bytes, roofline work, runtime memory), decoder state and phases, sample inputs and the
thin model file I/O. Imports only :mod:`partitioner.errors` (and :mod:`protocols`); the module
list is the map in :mod:`partitioner`.
"""
