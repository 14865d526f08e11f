"""The demo: ``fedshard demo``, a newcomer's first run on 127.0.0.1."""
