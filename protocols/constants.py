"""Names and versions both sides of the wire agree on."""

from __future__ import annotations

from typing import Final

SOFTWARE_VERSION: Final = "0.1.0"
PROTOCOL_VERSION: Final = 1
"""Bumped whenever a wire format changes incompatibly."""

SERVICE_TYPE: Final = "_fedshard._tcp.local."
"""DNS-SD service type every agent announces."""

MANIFEST_FORMAT: Final = "fedshard.manifest/1"
PROBLEM_FORMAT: Final = "fedshard.problem/1"
ROOFLINE_PROBLEM_FORMAT: Final = "fedshard.problem/2"
"""A planning problem whose units may be priced by the devices' roofs (see protocols.problem)."""

DEFAULT_MAX_FRAME_BYTES: Final = 256 * 1024 * 1024
"""Largest activation frame an agent accepts unless configured otherwise."""

DEFAULT_QUEUE_DEPTH: Final = 2
"""Frames an agent's stage queues hold (waiting for compute, and results waiting to be sent),
and what the planner reserves memory for: one number, so predictions match the agents."""
