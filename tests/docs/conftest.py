"""Tests of the documentation (``README.md``, ``docs/``, ``mkdocs.yml``): the pages' links,
paths and module names exist, and the generated CLI and HTTP API references list every command,
route and catalogued error the code has.

No fixtures of its own.
"""
