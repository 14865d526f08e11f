"""Prometheus metrics of one agent, in their own registry (served at ``/metrics``).

They answer "which stage is the bottleneck, and is a link or a device to blame": compute time
per request (the device), queue wait (work piling up before compute), send time (the link to the
next agent), bytes in and out, idle time of the compute worker, queue depths and memory.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from edge_agent.runtime.engine import resident_bytes

_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class AgentMetrics:
    """The agent's metrics; one instance per agent."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.compute_seconds = Histogram(
            "fedshard_compute_seconds",
            "Segment compute time per request",
            registry=r,
            buckets=_BUCKETS,
        )
        self.queue_wait_seconds = Histogram(
            "fedshard_queue_wait_seconds",
            "Time a request waited in the compute queue",
            registry=r,
            buckets=_BUCKETS,
        )
        self.send_seconds = Histogram(
            "fedshard_send_seconds",
            "Time to hand a frame to the next agent (or back to the requester)",
            registry=r,
            buckets=_BUCKETS,
        )
        self.batch_size = Histogram(
            "fedshard_batch_size",
            "Requests run together in one call (batches of more than one only)",
            registry=r,
            buckets=(2, 3, 4, 6, 8),
        )
        self.bytes_in = Counter("fedshard_bytes_in", "Data-plane bytes received", registry=r)
        self.bytes_out = Counter("fedshard_bytes_out", "Data-plane bytes sent", registry=r)
        self.idle_seconds = Counter(
            "fedshard_idle_seconds", "Time the compute worker waited for work", registry=r
        )
        self.requests = Counter(
            "fedshard_requests", "Requests handled by outcome", ["outcome"], registry=r
        )
        self.frame_errors = Counter(
            "fedshard_frame_errors", "Refused frames by error type", ["error"], registry=r
        )
        self.queue_depth = Gauge(
            "fedshard_queue_depth", "Frames waiting in a stage queue", ["queue"], registry=r
        )
        self.segment_memory = Gauge(
            "fedshard_segment_resident_bytes",
            "Resident memory the segment added when loaded",
            ["plan_version"],
            registry=r,
        )
        self.sessions = Gauge(
            "fedshard_sessions", "Generation sessions whose state this agent holds", registry=r
        )
        self.session_state_bytes = Gauge(
            "fedshard_session_state_bytes", "Bytes of per-session state (KV cache)", registry=r
        )
        self.resident = Gauge(
            "fedshard_resident_memory_bytes", "Resident memory of the agent process", registry=r
        )
        self.resident.set_function(lambda: float(resident_bytes()))

    def render(self) -> bytes:
        """Prometheus text exposition format."""
        return generate_latest(self.registry)
