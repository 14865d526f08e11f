"""Developer tools: demo, lab, the reference training task, the data-plane requester.

Imported by the ``fedshard`` command, tests and benchmarks; never by a product package.

- :mod:`devtools.demo`            ``fedshard demo``, a newcomer's first run on 127.0.0.1
    - :mod:`devtools.demo.cli`        the command: its parser and the run
    - :mod:`devtools.demo.procs`      the processes it starts: a coordinator and agents
    - :mod:`devtools.demo.steps`      its steps, each printing what it shows
    - :mod:`devtools.demo.supervise`  the serving loop: a lost agent is reported and restarted
    - :mod:`devtools.demo.chaos`      ``--chaos``: kill an agent under load, count what was lost
    - :mod:`devtools.demo.decoder`    a decoder exported, deployed across the agents, chatted with
    - :mod:`devtools.demo.gguf`       the demo's decoders served straight from packaged GGUF files
    - :mod:`devtools.demo.training`   LoRA of the chat model it serves, on three devices' text
- :mod:`devtools.lab`             the LAN lab: N hosts as network namespaces on a bridge (root)
    - :mod:`devtools.lab.cli`         ``fedshard lab up|down|exec|status``
    - :mod:`devtools.lab.__main__`    ``python -m devtools.lab``: the same without the dispatcher
    - :mod:`devtools.lab.spec`        :class:`~devtools.lab.spec.LabSpec`: what a lab should be
    - :mod:`devtools.lab.plan`        pure planning: names, addresses, ``ip``/``tc`` command lines
    - :mod:`devtools.lab.executor`    runs those command lists (never a shell), removes labs
    - :mod:`devtools.lab.lab`         a lab owned by this process, with its agents
    - :mod:`devtools.lab.state`       the state file that lets any process remove a lab
    - :mod:`devtools.lab.procs`       the lab's processes, identified by pid and start time
    - :mod:`devtools.lab.probe`       TCP and mDNS probes run inside the lab's namespaces
    - :mod:`devtools.lab.errors`      the lab's errors
- :mod:`devtools.digits`          the reference fine-tuning task: digits, a small CNN, four segments
- :mod:`devtools.wordnet`         WordNet 3.0 glosses as federated training data, by domain
- :mod:`devtools.lora_lab`        federated LoRA rounds over the agents' real client code, no Flower
- :mod:`devtools.lora_profile`    one device's LoRA round under cProfile
- :mod:`devtools.reference`       reference answers from the whole model in one session
- :mod:`devtools.requester`       a data-plane requester: requests into a chain, results by id
- :mod:`devtools.gguf_files`      small GGUF files with random weights, every architecture and type
- :mod:`devtools.import_hygiene`  a package's hidden imports and unmapped modules, read with ``ast``
- :mod:`devtools.docstring_refs`  docstring cross-references that name nothing, read with ``ast``
"""
