"""The worker runtime both worker kinds share: the Redis shell around an engine, its metrics and arguments."""
