"""Tests of the LAN lab (``devtools/lab/``): its planning layer, state file and executor (no
root), real labs of network namespaces on a bridge (root), and a link cut in the lab handled
like a killed agent.

No fixtures of its own; the shared helpers live in ``tests/`` (on ``sys.path`` through
``tests/conftest.py``): ``lab_helpers``, ``lab_client`` and ``failover_helpers``.
"""
