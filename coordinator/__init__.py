"""The fedshard coordinator: pairs devices, plans, deploys, serves, survives losses, trains.

Rooms, each importing only the rooms below it (an import-linter layers contract)::

    commands     ``fedshard coordinator | pair | revoke | deploy | rollback | devices``
    app | client composition root: builds every service once and runs the HTTP server;
                 the one typed client of the HTTP API (CLI verbs, demo, labs, tests, benches)
    http         everything FastAPI and nothing else: routes, bodies, the error catalogue
    serving | console | training
                 requests to deployed models (router, failover, embeddings, decoder backend);
                 the console's plans, stage metrics, stats and slowness; federated fine-tuning
    deploy | trust
                 deployer, plan (signed bodies), versions store; CA, identity, pairing,
                 revocation delivery
    fleet        device registry, mDNS discovery, liveness, link measurement
    generation | transport
                 pure text generation (engine, sampling, tokenizer, backend, step feeds); bytes
                 to agents (control-plane and data-plane clients, TLS, wire error codes)
    config | errors
                 the configuration built at the entry point; the error hierarchy

- :mod:`coordinator.app`          :func:`~coordinator.app.serve`: the coordinator process
- :mod:`coordinator.client`       :class:`~coordinator.client.CoordinatorClient`: the API, typed
- :mod:`coordinator.commands`     the coordinator's CLI verbs
- :mod:`coordinator.config`       :class:`~coordinator.config.CoordinatorConfig` (with its
  ``Timeouts`` and ``Retries``), the API's port and URL
- :mod:`coordinator.errors`       the error hierarchy (drawn in its docstring)
- :mod:`coordinator.http`         everything FastAPI
    - :mod:`coordinator.http.app`             create_app: devices, pairing, models, behind a token
    - :mod:`coordinator.http.server`          uvicorn with deadlines and caps on connections
    - :mod:`coordinator.http.guard`           ASGI guard: token and body size checked before reading
    - :mod:`coordinator.http.timing`          the one request timer the metrics and console observe
    - :mod:`coordinator.http.errors`          one catalogue: every error to its status, OpenAI
      type/code, Retry-After
    - :mod:`coordinator.http.devices`         ``/v1/devices`` and ``/v1/pairing``
    - :mod:`coordinator.http.device_models`   their models, without FastAPI
    - :mod:`coordinator.http.serving`         deployments, models, inference and embeddings
    - :mod:`coordinator.http.npz`             ``.npz`` bodies read with sizes checked first
    - :mod:`coordinator.http.openai`          OpenAI-compatible text generation routes
    - :mod:`coordinator.http.openai_models`   their bodies
    - :mod:`coordinator.http.openai_serving`  OpenAI-compatible models and embeddings routes
    - :mod:`coordinator.http.replies`         the replies routes build as plain JSON, as models
    - :mod:`coordinator.http.console`         the routes the web console needs beyond the core API
    - :mod:`coordinator.http.training`        the training-run routes
    - :mod:`coordinator.http.metrics`         Prometheus metrics at ``GET /metrics``
- :mod:`coordinator.serving`      requests to deployed models
    - :mod:`coordinator.serving.router`      named tensors in, the active version's chain, back
    - :mod:`coordinator.serving.failover`    a lost device's model re-planned on the devices left
    - :mod:`coordinator.serving.embeddings`  ``/v1/embeddings``: tokenizer here, encoder on chain
    - :mod:`coordinator.serving.microbatch`  a large embeddings request as runs of bounded size
    - :mod:`coordinator.serving.decoder`     a decoder over the agents: steps as data-plane requests
- :mod:`coordinator.console`      the web console's static page (``static/``)
    - :mod:`coordinator.console.plans`     each stage's device, units, memory, time; what-ifs
    - :mod:`coordinator.console.stages`    per-stage pipeline metrics from the agents' ``/metrics``
    - :mod:`coordinator.console.stats`     requests per second and latency percentiles
    - :mod:`coordinator.console.slowness`  each stage's measured compute time against the plan's
- :mod:`coordinator.training`     federated fine-tuning (its own map: ``manager``, ``driver``,
  ``runner``, ``target``, ``strategy``, ``server_app``, ... and the ``lora`` room)
- :mod:`coordinator.deploy`       plan, split, sign and push versions; the versions store (its own
  map, GGUF deploys included)
- :mod:`coordinator.trust`        the CA, identity, pairing and revocation delivery
    - :mod:`coordinator.trust.ca`         the CA: certifies paired devices, signs deployments
    - :mod:`coordinator.trust.identity`   the coordinator's own ``coordinator``-role certificate
    - :mod:`coordinator.trust.offers`     pending pairing offers, in memory, matched by code
    - :mod:`coordinator.trust.pairing`    approve by code; revoked ones stay out
    - :mod:`coordinator.trust.exchanges`  background pairing and revocation exchanges with agents
    - :mod:`coordinator.trust.delivery`   pairing and revocation over the control planes
    - :mod:`coordinator.trust.renewal`    new certificates for paired agents before theirs expire
- :mod:`coordinator.fleet`        what the coordinator knows of the devices
    - :mod:`coordinator.fleet.registry`         the live device registry
    - :mod:`coordinator.fleet.discovery`        mDNS discovery (the only zeroconf module)
    - :mod:`coordinator.fleet.liveness`         a control-plane ping of every paired agent
    - :mod:`coordinator.fleet.links`            link measurement between paired agents
    - :mod:`coordinator.fleet.requester_links`  the coordinator's own links to the agents
- :mod:`coordinator.generation`   pure text generation
    - :mod:`coordinator.generation.backend`      the interface the engine drives: one decoder
    - :mod:`coordinator.generation.engine`       one generation: prefill, then decode steps
    - :mod:`coordinator.generation.feeds`        the tensors one step sends through the chain
    - :mod:`coordinator.generation.sampling`     the next token from the top-k candidates
    - :mod:`coordinator.generation.tokenizer`    tokenizer, chat template, detokenization
    - :mod:`coordinator.generation.speculative`  draft k tokens, verify them in one pass
    - :mod:`coordinator.generation.drafters`     cheap guesses of the next tokens
    - :mod:`coordinator.generation.draft_model`  a small decoder as the drafter, run here
    - :mod:`coordinator.generation.tuning`       how many tokens to draft, from measured throughput
- :mod:`coordinator.transport`    bytes to agents
    - :mod:`coordinator.transport.agent_client`  control plane: one HTTPS request per connection
    - :mod:`coordinator.transport.bounded_http`  one exchange under a deadline and a size cap
    - :mod:`coordinator.transport.dataplane`     data plane: requests in, results by request id
    - :mod:`coordinator.transport.tls`           the client TLS context, the peer-certificate check
    - :mod:`coordinator.transport.wire_errors`   an agent's wire error codes to our errors

Below every room: :mod:`protocols` (formats), :mod:`partitioner` (planning and cutting) and
:mod:`hostkit` (atomic writes, process-tree stop). The coordinator never imports
:mod:`edge_agent` or :mod:`devtools` (demo, lab, the digits task live there); the ``fedshard``
command that registers all of their subcommands is the top-level :mod:`fedshard` package.
"""
