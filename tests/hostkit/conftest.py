"""Tests of the host helpers (``hostkit/``): stopping a process tree.

No fixtures of its own.
"""
