"""Tests of the developer tools' own units (``devtools/``): the demo's answers, its chaos run and
supervisor. The lab's tests are in ``tests/lab/``; the demo as a user runs it in ``tests/e2e/``.

No fixtures of its own.
"""
