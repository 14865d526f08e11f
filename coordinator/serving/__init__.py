"""Serving: requests to deployed models (router, failover, embeddings, the decoder backend)."""
