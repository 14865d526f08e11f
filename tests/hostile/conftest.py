"""Hostile input, one file per attack surface: the API schema (schemathesis), mDNS discovery,
frames, fuzzed decoders, limits before authentication, pairing-code guessing, segments, TLS
peers from another CA, trust and revocation, dripping and shadowing peers.

No fixtures of its own; the shared helpers live in ``tests/`` (on ``sys.path`` through
``tests/conftest.py``): ``agent_helpers``, ``agent_fakes``, ``coordinator_helpers`` and
``pairing_helpers``.
"""
