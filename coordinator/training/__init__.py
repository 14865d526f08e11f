"""Federated fine-tuning on the coordinator: Flower SuperLink, ServerApp, rollout of versions.

- :mod:`coordinator.training.segments`   cut an ONNX chain, read and rewrite initializers, run it
- :mod:`coordinator.training.shardavg`   shard-wise FedAvg (pure numpy) and the Flower strategy
- :mod:`coordinator.training.accounting` (epsilon, delta) from Flower's RDP accountant
- :mod:`coordinator.training.records`    round metrics and lineage records (frozen, JSON)
- :mod:`coordinator.training.server_app` the ServerApp (SecAgg+, DP, shard-wise FedAvg)
- :mod:`coordinator.training.flower`     flower-superlink and ``flwr run`` process management
- :mod:`coordinator.training.rollout`    new weights into ONNX initializers, new version dirs
- :mod:`coordinator.training.target`     the configured training target (``--training-target``)
- :mod:`coordinator.training.manager`    the runs behind ``/v1/training/runs``, one at a time
- :mod:`coordinator.training.driver`     one federated run, end to end (``flwr run``)
- :mod:`coordinator.training.runner`     the manager's runner: Flower, then rollout
- :mod:`coordinator.training.polling`    following a ``flwr run`` by its ServerApp's record
- :mod:`coordinator.training.cli`        ``fedshard train``
- :mod:`coordinator.training.strategy`   Flower strategies: shard-wise FedAvg, optionally with DP
- :mod:`coordinator.training.flower_types`  the types a Flower strategy's methods take and return
- :mod:`coordinator.training.version`    a deployment version on disk: manifest and segment files
- :mod:`coordinator.training.copies`     the version a run trains, sent to the training agents
- :mod:`coordinator.training.heldout`    held-out and client data files (``.npz``, never pickled)
- :mod:`coordinator.training.local_agents`  SuperNode processes on 127.0.0.1 for the demo
- :mod:`coordinator.training.revoked_nodes`  a revoked device's SuperNode unregistered
- :mod:`coordinator.training.errors`     the errors of federated fine-tuning
- :mod:`coordinator.training.lora`       federated LoRA of a served model (its own room)

Nothing here imports torch or Flower at module level except the ServerApp. The reference digits
task lives in :mod:`devtools.digits`.
"""
