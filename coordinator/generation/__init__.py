"""OpenAI-compatible text generation: the engine, sampling, tokenizer and HTTP routes.

:mod:`.backend` is the interface a decoder backend implements; :mod:`.engine` drives one
generation over it; :mod:`.api_generation` serves ``/v1/chat/completions`` and
``/v1/completions``.
"""
