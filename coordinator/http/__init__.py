"""HTTP: everything FastAPI and nothing else (routes, bodies, error rendering)."""
