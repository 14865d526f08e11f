"""The LAN lab: N hosts on one machine as network namespaces on a bridge (root needed).

- :mod:`~coordinator.lab.spec`: what the lab should be (:class:`LabSpec`);
- :mod:`~coordinator.lab.plan`: pure planning, names, addresses and ``ip``/``tc`` commands;
- :mod:`~coordinator.lab.executor`: runs those commands and tears labs down;
- :mod:`~coordinator.lab.lab`: :class:`Lab`, a lab owned by this process (with its agents);
- :mod:`~coordinator.lab.state`: the JSON state file that lets another process remove it;
- :mod:`~coordinator.lab.probe`: TCP and mDNS probes run inside the lab's namespaces;
- :mod:`~coordinator.lab.cli`: ``fedshard lab up|down|exec|status``.

Nothing is imported here, so probes started inside namespaces stay quick to start.
"""
