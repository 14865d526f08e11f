"""The ``fedshard`` command: the one entry point, above every package.

- :mod:`fedshard.cli`       builds the parser from each package's ``register`` and runs a handler
- :mod:`fedshard.__main__`  ``python -m fedshard``

It is the only module that imports the agent, the coordinator, the partitioner and the developer
tools together; nothing imports it.
"""
