"""Helpers for demos, labs, benchmarks and tests; never imported by the product packages."""
