"""Who this device is and whom it trusts: identity, pairing, certificate renewal (see the map
in :mod:`edge_agent`)."""
