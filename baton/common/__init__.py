"""The bottom layer: what every service shares and nothing above it defines: the wire contract
(protocol, sampling params, finish reasons), the Redis client and its failure set, URLs, logs,
tracing, flags from the environment, heartbeats, grammar compiles, and where model files come from."""
