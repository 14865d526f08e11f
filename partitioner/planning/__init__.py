"""The planning room: planning problems in, optimal plans out (pure functions, no files).

The public entry points are :func:`partitioner.planning.planner.plan` and
:func:`partitioner.planning.planner.evaluate`; the other modules are how they work (exact
semantics, device classes, the layered dynamic programme), the problem built from a graph's
units, and the baselines the planner is measured against. Imports :mod:`partitioner.analysis`
and :mod:`partitioner.errors` only; the module list is the map in :mod:`partitioner`.
"""
