"""The fedshard edge agent: one per device; it runs one segment of a model per plan version.

Rooms, each importing only the rooms below it (the import-linter layers contract
``edge_agent rooms`` in ``pyproject.toml``)::

    __main__ > cli > serve > training | profile > net > runtime > trust > protobuf > config > errors

- :mod:`edge_agent.__main__`  ``python -m edge_agent``
- :mod:`edge_agent.cli`       ``fedshard agent`` and ``fedshard profile`` (light to import:
  ``fedshard.cli`` imports it; what needs ``fedshard[agent]`` is imported in the handlers)
- :mod:`edge_agent.serve`     the running agent: process wiring, control and data planes
    - :mod:`edge_agent.serve.service`   process wiring: signals, identity, profile, event loop
    - :mod:`edge_agent.serve.agent`     the running agent: control and data planes, advertising
    - :mod:`edge_agent.serve.pipeline`  data-plane request handling: queues, compute, forwarding
    - :mod:`edge_agent.serve.compute`   a stage's compute: one request, a session step, or a batch
    - :mod:`edge_agent.serve.metrics`   Prometheus metrics
- :mod:`edge_agent.training`  optional federated fine-tuning (``fedshard[agent,train]``); the
  agent imports only its :mod:`~edge_agent.training.copies` (no torch, no Flower), the CLI its
  :mod:`~edge_agent.training.supernode`; it stands on ``net`` (the control plane's routes) and
  ``trust`` (signatures, the node key)
- :mod:`edge_agent.profile`   the device profile's measurements (the roofs), cached in state
    - :mod:`edge_agent.profile.microbench`   the compute roof and the cached profile of all roofs
    - :mod:`edge_agent.profile.membench`     memory roof, cache level, operator/call/TopK costs
    - :mod:`edge_agent.profile.gemvbench`    the one-row 4-bit product (GEMV) roof
    - :mod:`edge_agent.profile.vectorbench`  the element-wise (vector) roof
    - :mod:`edge_agent.profile.base`         the profile models' base, the best-trial timer
- :mod:`edge_agent.net`       transports and wire-facing handling (TLS, frames, control)
    - :mod:`edge_agent.net.tls`           TLS 1.3 contexts, peer name/role checks, revocation
    - :mod:`edge_agent.net.channel`       data-plane transport (frame channels over TLS/TCP)
    - :mod:`edge_agent.net.frame_budget`  the unfinished-frame budget a server's connections share
    - :mod:`edge_agent.net.budgets`       what the listeners may hold, derived from ``--memory``
    - :mod:`edge_agent.net.links`         persistent connections to the next agent
    - :mod:`edge_agent.net.probe`         link probe (latency, bandwidth)
    - :mod:`edge_agent.net.routing`       who may send what to a stage; routed ids, answers' claims
    - :mod:`edge_agent.net.control`       the control plane's small HTTPS server
    - :mod:`edge_agent.net.wire_errors`   its exceptions to the wire's error codes (one table)
    - :mod:`edge_agent.net.discovery`     mDNS advertiser and browser (the only zeroconf module)
- :mod:`edge_agent.runtime`   running segments in ONNX Runtime, and their state
    - :mod:`edge_agent.runtime.engine`       ONNX Runtime sessions, memory measurement, warm-up
    - :mod:`edge_agent.runtime.segments`     deploy checks and the loaded segments
    - :mod:`edge_agent.runtime.checks`       frame tensors against a segment's declared inputs
    - :mod:`edge_agent.runtime.batching`     queued requests of a stateless stage run as one batch
    - :mod:`edge_agent.runtime.sessions`     per-session state (a decoder's KV cache) between steps
    - :mod:`edge_agent.runtime.fixed_costs`  operator/call/TopK costs measured at every warm-up
- :mod:`edge_agent.trust`     who this device is and whom it trusts
    - :mod:`edge_agent.trust.identity`  key pair, certificates, deploy-signature verification
    - :mod:`edge_agent.trust.pairing`   the agent's side of pairing (code, CSR, grant)
    - :mod:`edge_agent.trust.renewal`   certificate renewal before expiry
- :mod:`edge_agent.protobuf`  the hand-written ONNX protobuf writer and reader (no ``onnx``)
    - :mod:`edge_agent.protobuf.writer`  small models serialized field by field
    - :mod:`edge_agent.protobuf.limits`  declared-size checks before ONNX Runtime parses a segment
- :mod:`edge_agent.config`    :class:`~edge_agent.config.AgentConfig`, built once at the entry point
- :mod:`edge_agent.errors`    the error hierarchy (drawn in its docstring)

Why this order:

- ``net`` sits above ``runtime``: frames carry the runtime's arrays (``runtime.checks.Array``),
  and the stage's compute, which needs both a runtime and a channel, lives in ``serve``.
- ``profile`` sits above ``runtime``: the roofs run in ONNX Runtime with the agent's session
  options, while the runtime imports no benchmark (the fixed-cost probe each warm-up runs is
  ``runtime.fixed_costs``; the models it writes come from ``protobuf``).
- ``training`` and ``profile`` are independent of each other; both are below ``serve``.
- ``protobuf`` imports only ``errors`` (the reader's refusals are the agent's own errors).
"""
