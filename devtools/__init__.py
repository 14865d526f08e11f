"""Developer tools: demo, lab, the reference training task, the data-plane requester.

Imported by the ``fedshard`` command, tests and benchmarks; never by a product package.
"""
