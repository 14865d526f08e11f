"""fedshard's wire and file formats, shared by every other package and importing none of them.

- :mod:`protocols.constants`  service type, versions, format names, limits
- :mod:`protocols.errors`     the error hierarchy (drawn in its docstring)
- :mod:`protocols.profile`    device profile and agent state
- :mod:`protocols.txt`        mDNS TXT codec for the profile
- :mod:`protocols.frames`     activation frame codec (data plane)
- :mod:`protocols.problem`    ``fedshard.problem/1`` planning problems
- :mod:`protocols.plan`       plans and objectives
- :mod:`protocols.devices`    ``DEVICES.json``
- :mod:`protocols.manifest`   ``fedshard.manifest/1``
- :mod:`protocols.deploy`     the control plane: signed deploys, status, probes, revocations
- :mod:`protocols.pairing`    pairing codes, offers and grants
- :mod:`protocols.base`       the base of every wire and file model: frozen, unknown fields and
  non-finite numbers refused
- :mod:`protocols.sizes`      byte sizes as people write them (``64MiB``, ``1.5GB``, ``4096``)
- :mod:`protocols.links`      measured links between devices and from the requester to each
- :mod:`protocols.roofs`      the roofs a device states beside its compute roof
- :mod:`protocols.decoder`    ``fedshard.decoder/1``: how a decoder model's ONNX graph is laid out
- :mod:`protocols.gguf_card`  ``fedshard.gguf-card/1``: what a deployed GGUF file is, and what
  building its segments cost
- :mod:`protocols.quant`      what a :class:`~protocols.lora.QuantRef` means: the float weight of a
  quantized initializer
- :mod:`protocols.lora`       ``fedshard.loraplan/1``: federated LoRA of a served model's segments
- :mod:`protocols.training`   what the coordinator's ServerApp and the agents' ClientApp agree on
- :mod:`protocols.training_copy`  ``fedshard.training-copy/1``: the served version a training
  agent fine-tunes
- :mod:`protocols.privacy`    what leaves a training device in a round, and how
- :mod:`protocols.ledger`     ``fedshard.privacyledger/1``: what a training device's records spent
"""
