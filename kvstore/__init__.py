"""The KV block store: stable block ids (chained hashes), its backends (Redis, in memory) and the
connector through which an engine's scheduler loads and saves blocks."""
