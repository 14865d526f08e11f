"""The hand-written ONNX protobuf writer and reader: the agent does not depend on ``onnx``
(see the map in :mod:`edge_agent`)."""
