"""End-to-end flows with real processes on 127.0.0.1, the way a user runs them: a coordinator and
agents (embeddings, generation, speculative decoding, chunked prefill, failover, load, the
prediction band, memory truth, the console in a browser, the OpenAI SDK, ``fedshard demo``) and
federated fine-tuning through Flower (SuperLink, SuperNodes, ``flwr run``).

No fixtures of its own; the shared ones (exports, cached real models) are in
``tests/conftest.py`` and the helpers in ``tests/``: ``agent_helpers``, ``coordinator_helpers``,
``generation_lab``, ``load_lab`` and ``failover_helpers``.
"""
