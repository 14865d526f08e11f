"""The device profile's measurements: compute, memory, GEMV and vector roofs and the fixed
costs, cached in the agent's state (see the map in :mod:`edge_agent`)."""
