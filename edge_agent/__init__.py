"""The fedshard edge agent: one per device; it runs one segment of a model per plan version.

- :mod:`edge_agent.cli`         ``fedshard agent`` and ``fedshard profile`` (light to import)
- :mod:`edge_agent.service`     process wiring: signals, identity, profile, event loop
- :mod:`edge_agent.agent`       the running agent: control and data planes, advertising
- :mod:`edge_agent.config`      :class:`AgentConfig`, built once at the entry point
- :mod:`edge_agent.errors`      the error hierarchy (drawn in its docstring)
- :mod:`edge_agent.identity`    key pair, certificates, deploy-signature verification
- :mod:`edge_agent.tls`         TLS 1.3 contexts, peer name/role checks, revocation
- :mod:`edge_agent.pairing`     the agent's side of pairing (code, CSR, grant)
- :mod:`edge_agent.microbench`  GFLOP/s micro-benchmark, cached profile
- :mod:`edge_agent.runtime`     ONNX Runtime sessions, memory measurement, warm-up
- :mod:`edge_agent.segments`    deploy checks and the loaded segments
- :mod:`edge_agent.checks`      frame tensors against a segment's declared inputs
- :mod:`edge_agent.channel`     data-plane transport (frame channels over TLS/TCP)
- :mod:`edge_agent.pipeline`    data-plane request handling: queues, compute, forwarding
- :mod:`edge_agent.links`       persistent connections to the next agent
- :mod:`edge_agent.probe`       link probe (latency, bandwidth)
- :mod:`edge_agent.wire_errors` its exceptions to the wire's error codes (one table)
- :mod:`edge_agent.control`     the control plane's small HTTPS server
- :mod:`edge_agent.metrics`     Prometheus metrics
- :mod:`edge_agent.discovery`   mDNS advertiser and browser (the only zeroconf module)
- :mod:`edge_agent.training`    optional federated fine-tuning (``fedshard[agent,train]``)
"""
