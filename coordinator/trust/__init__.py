"""Trust: the CA, the coordinator's identity, pairing and revocation delivery."""
