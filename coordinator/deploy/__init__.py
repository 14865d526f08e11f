"""Deployment: plan, split, sign and push versions; the versions store."""
