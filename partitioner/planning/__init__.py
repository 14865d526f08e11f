"""The planner's internals: exact semantics, device classes, the layered dynamic programme.

The public entry points are :func:`partitioner.planning.planner.plan` and
:func:`partitioner.planning.planner.evaluate`; the modules here are how they work:

- :mod:`~partitioner.planning.semantics`: the ``fedshard.problem/1`` cost model, scalar and exact;
- :mod:`~partitioner.planning.tables`: the same model as numpy tables indexed by cut position;
- :mod:`~partitioner.planning.fleet`: interchangeable devices grouped into classes;
- :mod:`~partitioner.planning.engine`: the dynamic programme over class count vectors;
- :mod:`~partitioner.planning.synthetic`: large synthetic problems for scale tests and benchmarks.
"""
