"""fedshard edge_agent."""
