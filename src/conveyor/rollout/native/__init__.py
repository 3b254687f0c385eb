"""rollout/native."""
