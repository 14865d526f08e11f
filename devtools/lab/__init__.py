"""The LAN lab: N hosts on one machine as network namespaces on a bridge (root needed).

- :mod:`~devtools.lab.spec`: what the lab should be (:class:`~devtools.lab.spec.LabSpec`);
- :mod:`~devtools.lab.plan`: pure planning, names, addresses and ``ip``/``tc`` commands;
- :mod:`~devtools.lab.executor`: runs those commands and tears labs down;
- :mod:`~devtools.lab.lab`: :class:`~devtools.lab.lab.Lab`, a lab owned by this process (with
  its agents);
- :mod:`~devtools.lab.state`: the JSON state file that lets another process remove it;
- :mod:`~devtools.lab.probe`: TCP and mDNS probes run inside the lab's namespaces;
- :mod:`~devtools.lab.cli`: ``fedshard lab up|down|exec|status``.

Nothing is imported here, so probes started inside namespaces stay quick to start.
"""
