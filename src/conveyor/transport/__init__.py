"""transport."""
