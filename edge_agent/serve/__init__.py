"""The running agent: process wiring, control and data planes, the stage pipeline, metrics
(see the map in :mod:`edge_agent`)."""
