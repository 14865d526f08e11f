"""Tests of the ``fedshard`` command and its packaging: the command stays light on an edge
device, and the install extras cover what the code imports.

No fixtures of its own.
"""
