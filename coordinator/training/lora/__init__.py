"""Federated LoRA of a served model on the coordinator: plan, Flower ServerApp, merge, rollout.

- :mod:`coordinator.training.lora.plan`        the :class:`~protocols.lora.LoraPlan` of a served
  decoder, from its export's LoRA base (architecture, config, weight map)
- :mod:`coordinator.training.lora.records`     the ServerApp's run file and per-round record
- :mod:`coordinator.training.lora.server_app`  the ServerApp: FedAvg over adapters, SecAgg+
- :mod:`coordinator.training.lora.runner`      one run end to end: federation, follow, rollout
- :mod:`coordinator.training.lora.target`      which served version and devices a run trains
- :mod:`coordinator.training.lora.version`     adapters merged into a new signed version
- :mod:`coordinator.training.lora.whole`       the whole merged model, so a version re-plans
- :mod:`coordinator.training.lora.cli`         ``fedshard train --model ID``
"""
