"""Prefill worker: chunked prefill, KV blocks to the store, first token, handoff to decode."""
