"""Tests of the coordinator (``coordinator/``), in process with fakes where they can: the API,
console, configuration, CA, pairing, trust, registry and discovery, deploy (planning, pushing,
serving shapes, stage timing, residuals), the data-plane client, serving (micro-batches, shape
limits, slowness, HTTP errors, metrics), generation (units, API, speculation, draft models,
tuning) and training (runs, targets, polling, copies, LoRA plans and versions).

No fixtures of its own; the shared helpers live in ``tests/`` (on ``sys.path`` through
``tests/conftest.py``): ``pairing_helpers``, ``generation_helpers``, ``graph_helpers``,
``agent_helpers`` and ``coordinator_helpers``.
"""
