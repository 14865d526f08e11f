"""Running segments in ONNX Runtime: sessions, deploy checks, frame checks, batching,
per-session state and fixed costs (see the map in :mod:`edge_agent`)."""
