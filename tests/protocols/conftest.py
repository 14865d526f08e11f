"""Tests of the wire and file formats (``protocols/``): the activation frame codec, the TXT
codec, the JSON schemas (devices, plan, problem, manifest), byte sizes, fuzzing of the decoders,
and the typed wire errors that both the agent and the coordinator map to and from its codes.

No fixtures of its own; ``tests/conftest.py`` holds the shared ones.
"""
