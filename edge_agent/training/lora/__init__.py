"""A device's federated LoRA round: frozen segments in ONNX Runtime, the tail in torch + PEFT.

- :mod:`edge_agent.training.lora.train`    a decoder round: records, frozen prefix, train, evaluate
- :mod:`edge_agent.training.lora.pairs`    an encoder's round on ``{"anchor", "positive"}`` pairs
- :mod:`edge_agent.training.lora.model`    the trainable tail from transformers' own modules
- :mod:`edge_agent.training.lora.encoder`  BERT tail, mean pooling, in-batch-negatives loss, recall
- :mod:`edge_agent.training.lora.loop`     epochs, Opacus DP-SGD and its accountant, torch threads
- :mod:`edge_agent.training.lora.dp`       DP-SGD randomness from ``os.urandom`` (no seed)
"""
