"""Transport: bytes to agents (control-plane client, data-plane client)."""
