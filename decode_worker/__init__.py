"""Decode worker: iteration-level continuous batching over a paged KV pool."""
