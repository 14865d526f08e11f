"""Text generation, pure: the engine, sampling, tokenizer, backend interface and step feeds.

:mod:`.backend` is the interface a decoder backend implements; :mod:`.engine` drives one
generation over it; :mod:`.feeds` builds a step's tensors. The OpenAI-compatible routes that
serve it (``/v1/chat/completions``, ``/v1/completions``) are :mod:`coordinator.http.openai`.
"""
