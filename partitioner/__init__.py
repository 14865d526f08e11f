"""fedshard partitioner."""
