"""The dead-letter console: its catalog, its server's checks, and the whole flow in a real browser."""
