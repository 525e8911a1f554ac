"""Operations: the `baton` command, `baton serve`, model fetching, the private Redis server."""
