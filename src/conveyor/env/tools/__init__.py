"""Tools environments hand to the model (``conveyor.env.api.Tool`` instances)."""
