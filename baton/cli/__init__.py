"""The top layer: the `baton` command (serve, fetch, bench, ...), the supervisor that runs every
service on one machine, a private Redis server for it, and the benchmark client."""
