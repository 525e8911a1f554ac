"""The KV block store, the bottom layer (it imports nothing from baton): stable block ids (chained
hashes), the block codec, store keys, and the backends that read and write blocks (Redis, and an
in-memory stand-in for tests)."""
