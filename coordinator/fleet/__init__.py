"""The fleet: registry, discovery, liveness, link measurement."""
