<<<<<<< HEAD
"""Developer tools: demo, lab, the reference training task, the data-plane requester.

Imported by the ``fedshard`` command, tests and benchmarks; never by a product package.
"""
=======
"""Helpers for demos, labs, benchmarks and tests; never imported by the product packages."""
>>>>>>> lora
