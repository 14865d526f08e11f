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
"""
