"""Transports and wire-facing handling: TLS, frame channels, links, probes, routing, the
control plane's server, wire error codes, mDNS (see the map in :mod:`edge_agent`)."""
