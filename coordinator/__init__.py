"""fedshard coordinator."""
