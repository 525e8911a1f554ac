"""Every Baton process makes its Redis client here, from one URL: a single Redis, a Redis Cluster or
a Sentinel-managed master.

    redis://[user:pass@]host:port[/db]             one Redis (rediss:// for TLS, unix:// too)
    redis+cluster://[user:pass@]host:port[,host:port...]   a Redis Cluster: any reachable seed
                                                   node; the client learns the slots' masters
    redis+sentinel://[user:pass@]host:port[,host:port...]/service[/db]   the master Sentinel
                                                   names for `service`, followed across failovers
    rediss+cluster://, rediss+sentinel://          the same over TLS

The scheme, not a probe of the server, decides: a client is made before Redis is reachable (the
gateway comes up and answers 503 while Redis is down), and the choice must not depend on which
node answered first. Query parameters are redis-py's (`?ssl_cert_reqs=none`, `?socket_timeout=`);
on a Sentinel URL, `sentinel_password` / `sentinel_username` authenticate to the Sentinels (the
URL's own credentials are the master's).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from redis.exceptions import RedisClusterException, RedisError

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}


# What a call raises when Redis cannot serve it. A Redis Cluster client that reaches no node raises
# RedisClusterException, which is no RedisError: code that catches only RedisError crashes there.
REDIS_FAILURES = (RedisError, RedisClusterException, OSError)


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme.lower() in CLUSTER_SCHEMES


def is_cluster(client: Any) -> bool:
    """Whether `client` (or the client of a pipeline) talks to a Redis Cluster: there, writes to
    keys of different slots are neither ordered nor atomic within one pipeline."""
    from redis.asyncio.cluster import ClusterPipeline, RedisCluster
    from redis.cluster import ClusterPipeline as SyncClusterPipeline, RedisCluster as SyncRedisCluster

    return isinstance(client, (RedisCluster, SyncRedisCluster, ClusterPipeline, SyncClusterPipeline))


def connect(url: str, **kwargs: Any) -> Any:
    """An asyncio client for `url` (`redis.asyncio.Redis` or `RedisCluster`); `kwargs` are
    connection options (timeouts, retry, decode_responses)."""
    import redis.asyncio as aioredis
    from redis.asyncio import sentinel
    from redis.asyncio.connection import parse_url

    scheme = urlsplit(url).scheme.lower()
    if scheme not in CLUSTER_SCHEMES and scheme not in SENTINEL_SCHEMES and "connection_class" not in kwargs:
        kwargs = {**kwargs, "connection_class": _lost_is_connection_error(
            parse_url(url).get("connection_class", aioredis.Connection))}
    return _connect(url, kwargs, aioredis.Redis, aioredis.RedisCluster, sentinel.Sentinel)


def _lost_is_connection_error(base: type) -> type:
    """`base` (a redis.asyncio connection class) whose sends on a connection Redis has just closed
    raise ConnectionError. uvloop reports them as RuntimeError ("... the handler is closed"), which
    every retry loop would take for a bug: after a Redis restart it once ended the gateway's token
    reader, and a worker loop would crash the same way."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    class LostIsConnectionError(base):  # type: ignore[misc, valid-type]
        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            try:
                await super().send_packed_command(command, check_health)
            except RuntimeError as exc:
                if "handler is closed" not in str(exc):
                    raise
                await self.disconnect(nowait=True)
                raise RedisConnectionError(f"connection to Redis lost: {exc}") from exc

    LostIsConnectionError.__name__ = LostIsConnectionError.__qualname__ = f"LostIsConnectionError{base.__name__}"
    return LostIsConnectionError


def connect_sync(url: str, **kwargs: Any) -> Any:
    """`connect` for synchronous code (`redis.Redis` or `redis.RedisCluster`)."""
    import redis
    from redis import sentinel

    return _connect(url, kwargs, redis.Redis, redis.RedisCluster, sentinel.Sentinel)


def _connect(url: str, kwargs: dict[str, Any], redis_class: Any, cluster_class: Any, sentinel_class: Any) -> Any:
    scheme = urlsplit(url).scheme.lower()
    if scheme in CLUSTER_SCHEMES:
        return _cluster(url, kwargs, cluster_class)
    if scheme in SENTINEL_SCHEMES:
        return _sentinel(url, kwargs, redis_class, sentinel_class)
    return redis_class.from_url(url, **kwargs)


def _split(url: str, schemes: dict[str, str]) -> tuple[str, str, list[tuple[str, int]], str, dict[str, str]]:
    """(plain scheme, userinfo, [(host, port)], path, query) of a URL with several hosts, which
    urllib cannot parse (its `port` refuses "h1:1,h2:2")."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes = []
    for hostport in hosts.split(","):
        host, sep, port = hostport.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{parts.scheme} URL: expected host:port, got {hostport!r}")
        nodes.append((host.strip("[]"), int(port)))
    return schemes[parts.scheme.lower()], userinfo, nodes, parts.path, dict(parse_qsl(parts.query))


def _options(scheme: str, userinfo: str, host: str, port: int, path: str, query: dict[str, str]) -> dict[str, Any]:
    """redis-py's own parsing of the connection options (credentials, TLS, query casts)."""
    from redis.connection import parse_url

    netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
    return parse_url(f"{scheme}://{netloc}{path}" + (f"?{urlencode(query)}" if query else ""))


def _cluster(url: str, kwargs: dict[str, Any], cluster_class: Any) -> Any:
    from redis.connection import SSLConnection

    scheme, userinfo, nodes, path, query = _split(url, CLUSTER_SCHEMES)
    options = _options(scheme, userinfo, *nodes[0], path, query)
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    seeds = [_node(cluster_class, host, port) for host, port in nodes[1:]]
    return cluster_class(**{**kwargs, **options}, startup_nodes=seeds or None)


def _node(cluster_class: Any, host: str, port: int) -> Any:
    import importlib

    # ClusterNode of the same flavour (sync or asyncio) as the client; it copies the client's
    # connection options onto each seed.
    return importlib.import_module(cluster_class.__module__).ClusterNode(host, port)


def _sentinel(url: str, kwargs: dict[str, Any], redis_class: Any, sentinel_class: Any) -> Any:
    from redis.connection import SSLConnection

    scheme, userinfo, nodes, path, query = _split(url, SENTINEL_SCHEMES)
    segments = [unquote(s) for s in path.split("/") if s]
    if not segments or len(segments) > 2:
        raise ValueError("a Sentinel URL names the service: redis+sentinel://host:port/<service>[/<db>]")
    service = segments[0]
    sentinel_auth = {k.removeprefix("sentinel_"): query.pop(k) for k in ("sentinel_username", "sentinel_password")
                     if k in query}
    options = _options(scheme, userinfo, *nodes[0], "/" + segments[1] if len(segments) == 2 else "", query)
    for name in ("host", "port"):  # the master's address comes from the Sentinels
        options.pop(name, None)
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    timeouts = {k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout")}
    sentinels = sentinel_class(nodes, sentinel_kwargs={**timeouts, **sentinel_auth})
    return sentinels.master_for(service, redis_class=redis_class, **{**kwargs, **options})
