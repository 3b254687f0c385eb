"""The environment pool: multi-turn environments, tools and their sandbox (docs/environments.md)."""
