"""Federated fine-tuning on an edge device (needs ``fedshard[agent,train]``: torch, Flower, onnx).

- :mod:`edge_agent.training.onnx_torch`  rebuild a trainable torch module from an ONNX segment
- :mod:`edge_agent.training.local`       choose shards by budget, cache frozen features, train
- :mod:`edge_agent.training.client_app`  the Flower ClientApp (SecAgg+ and DP clipping mods)
- :mod:`edge_agent.training.supernode`   start and stop a ``flower-supernode`` for this agent
- :mod:`edge_agent.training.text_data`   text records (JSONL, plain text), held out by hash
- :mod:`edge_agent.training.lora`        a federated LoRA round on this device (its own room)
- :mod:`edge_agent.training.copies`      the served version the coordinator sends before a run
- :mod:`edge_agent.training.ledger`      the privacy ledger, its composition and the budget
- :mod:`edge_agent.training.errors`      the errors of federated fine-tuning on this device

Nothing else in :mod:`edge_agent` imports this package but :mod:`.copies` (no torch, no Flower;
only when the agent trains), so the plain agent needs neither torch nor Flower.
"""
