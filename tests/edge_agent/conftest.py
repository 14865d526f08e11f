"""Tests of the edge agent (``edge_agent/``), one file per piece: batching, links, the MiniLM
segments, pairing, the data-plane pipeline, real agent processes, routing, sessions, the units
(config, checks, profile, identity, segment store), training (``--train-data``, LoRA text
records and the encoder's loss, DP) and its rooms (map, layers, imports).

The shared helpers live in ``tests/`` (on ``sys.path`` through ``tests/conftest.py``):
``agent_helpers`` (a test CA, tiny chains, agent processes) and ``agent_fakes`` (fake channels
and links, a segment store) for unit tests without sockets.
"""
