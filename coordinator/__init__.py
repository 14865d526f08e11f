"""The fedshard coordinator: pairs devices, plans, deploys, serves, survives losses, trains.

Rooms, each importing only the rooms below it (an import-linter layers contract)::

    commands     ``fedshard coordinator | pair | revoke | deploy | rollback | devices``
    app | client composition root: builds every service once and runs the HTTP server;
                 the one typed client of the HTTP API (the CLI verbs, the demo, tests)
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
- :mod:`coordinator.http`         ``app`` (create_app, devices, pairing), ``serving``, ``console``,
  ``training``, ``openai`` (+ ``openai_models``), ``errors`` (one catalogue, both body styles),
  ``timing`` (the one request timer the metrics and the console observe), ``device_models``
  (the device and pairing models, without FastAPI)
- :mod:`coordinator.serving.router`      ``router``, ``failover``, ``embeddings``, ``decoder``
- :mod:`coordinator.console`      the static page, ``plans``, ``stages``, ``stats``, ``slowness``
- :mod:`coordinator.training`     ``manager`` (runs), ``driver`` (one flwr run), ``runner``,
  ``target`` (the configured training target), ``strategy``, ``server_app``, ...
- :mod:`coordinator.deploy`       ``deployer``, ``plan``, ``store``
- :mod:`coordinator.trust.delivery`        ``ca``, ``identity``, ``pairing``, ``delivery``
- :mod:`coordinator.fleet`        ``registry``, ``discovery``, ``liveness``, ``links``,
  ``requester_links``
- :mod:`coordinator.generation`   ``engine``, ``sampling``, ``tokenizer``, ``backend``, ``feeds``
- :mod:`coordinator.transport`    ``agent_client``, ``dataplane``, ``tls``, ``wire_errors``

Below every room: :mod:`protocols` (formats), :mod:`partitioner` (planning and cutting) and
:mod:`hostkit` (atomic writes, process-tree stop). The coordinator never imports
:mod:`edge_agent` or :mod:`devtools` (demo, lab, the digits task live there); the ``fedshard``
command that registers all of their subcommands is the top-level :mod:`fedshard` package.
"""
