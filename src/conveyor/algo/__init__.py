"""algo."""
