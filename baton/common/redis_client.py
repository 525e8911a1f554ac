"""Every Baton process makes its Redis client here, from one URL: a single Redis, a Redis Cluster or
a Sentinel-managed master.

    redis://[user:pass@]host:port[/db]             one Redis (rediss:// for TLS, unix:// too)
    redis+cluster://[user:pass@]host:port[,host:port...]   a Redis Cluster: any reachable seed
                                                   node; the client learns the slots' masters
    redis+sentinel://[user:pass@]host:port[,host:port...]/service[/db]   the master Sentinel
                                                   names for `service`, followed across failovers
    rediss+cluster://, rediss+sentinel://          the same over TLS

The scheme decides, with one exception: a plain redis:// (rediss://) URL naming a Redis Cluster
node (`INFO cluster` says cluster_enabled:1), the scheme users try first, is used as that cluster
(one INFO line says so), as redis+cluster:// with that node as its seed would be. That probe is
made once, when the client is made; a Redis not reachable then gets a plain client (the gateway
comes up and answers 503 while Redis is down), and should it turn out to be a cluster node, its
first MOVED reply fails with ClusterNodeError, which names the URL (a worker exits on it, and its
restart detects the cluster). Query parameters are redis-py's (`?ssl_cert_reqs=none`, `?socket_timeout=`);
on a Sentinel URL, `sentinel_password` / `sentinel_username` authenticate to the Sentinels (the
URL's own credentials are the master's).

A password can also come from the environment, `BATON_REDIS_PASSWORD`: it is used when the URL
carries none (a URL's own password wins). Kubernetes hands it from a Secret (deploy/k8s), so the
URL itself holds no secret; like every password it never goes on a command line.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from redis.exceptions import ClusterDownError, ConnectionError as RedisConnectionError, MovedError, OutOfMemoryError
from redis.exceptions import RedisClusterException, RedisError, ResponseError, TimeoutError as RedisTimeoutError
from redis.exceptions import TryAgainError

from baton.common.urls import redact_url

log = logging.getLogger(__name__)

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
PLAIN_SCHEMES = {plain: cluster for cluster, plain in CLUSTER_SCHEMES.items()}  # redis -> redis+cluster
PROBE_TIMEOUT_S = 3.0


# "Redis is down", defined once for every process:
# - REDIS_FAILURES: what a call raises when Redis cannot serve it (the gateway answers 503). A Redis
#   Cluster client that reaches no node raises RedisClusterException, which is no RedisError: code
#   that catches only RedisError crashes there.
# - REDIS_RETRYABLE: those after which the same command can succeed later: the workers retry them with
#   backoff, never fatal. An out-of-memory Redis is one of them (it recovers as blocks expire or are
#   evicted; each retry's warning names it), so are a Cluster's failover states (a slot without a
#   master for a moment, a key being migrated) and its client reaching no node (which also covers a
#   cross-slot command, a bug the retry warnings then name).
# - REDIS_DOWN, for a long-lived loop (with `connection_lost`): uvloop reports a command sent on a
#   connection Redis has just closed as RuntimeError ("... the handler is closed"); `connect`'s
#   connections turn it into a ConnectionError, a Sentinel's master connections do not.
REDIS_FAILURES = (RedisError, RedisClusterException, OSError)
REDIS_RETRYABLE = (RedisConnectionError, RedisTimeoutError, OutOfMemoryError, OSError, ClusterDownError,
                   TryAgainError, RedisClusterException)
REDIS_DOWN = (*REDIS_FAILURES, RuntimeError)


def connection_lost(exc: BaseException) -> bool:
    """Whether `exc` (one of REDIS_DOWN) means the connection to Redis went away: retry later."""
    return not isinstance(exc, RuntimeError) or "handler is closed" in str(exc)


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme.lower() in CLUSTER_SCHEMES



def connect(url: str, **kwargs: Any) -> Any:
    """An asyncio client for `url` (`redis.asyncio.Redis` or `RedisCluster`); `kwargs` are
    connection options (timeouts, retry, decode_responses)."""
    import redis.asyncio as aioredis
    from redis.asyncio import sentinel
    from redis.asyncio.connection import parse_url

    url = cluster_url_of_node(url, kwargs) or url
    scheme = urlsplit(url).scheme.lower()
    if scheme not in CLUSTER_SCHEMES and scheme not in SENTINEL_SCHEMES and "connection_class" not in kwargs:
        kwargs = {**kwargs, "connection_class": _lost_is_connection_error(
            parse_url(url).get("connection_class", aioredis.Connection), url)}
    client = _connect(url, kwargs, aioredis.Redis, aioredis.RedisCluster, sentinel.Sentinel)
    if scheme in CLUSTER_SCHEMES:
        _cluster_lost_is_connection_error(client)
    elif scheme not in SENTINEL_SCHEMES:
        # from_url lets the URL's own options win, and a rediss:// URL names SSLConnection: set the
        # (wrapped) class after, before any connection exists, or TLS clients miss the wrapper
        client.connection_pool.connection_class = kwargs["connection_class"]
    return client


def _cluster_lost_is_connection_error(client: Any) -> None:
    """The same for the connections of an asyncio RedisCluster (whose constructor takes no
    connection class): a send on a connection to a master just killed raised uvloop's RuntimeError
    out of a worker's XREADGROUP and ended it; as ConnectionError, the client refreshes its slots
    (it learns the promoted replica) and the worker's loop retries."""
    lost = _lost_is_connection_error(client.connection_kwargs["connection_class"], moved=False)
    client.connection_kwargs["connection_class"] = lost  # the nodes it discovers copy these options
    for node in [*client.startup_nodes, *client.nodes_manager.startup_nodes.values()]:
        node.connection_class = lost


class ClusterNodeError(ResponseError):
    """A plain client's command got a MOVED reply: its URL names a Redis Cluster node, which was
    not reachable when the client was made (else the client would be a cluster client)."""


# Plain URLs already probed by this process: whether each is a cluster node. Only answers are kept
# (a Redis that was down is asked again by the next client).
_probed: dict[str, bool] = {}


def cluster_url_of_node(url: str, kwargs: dict[str, Any] | None = None) -> str | None:
    """The redis+cluster:// (rediss+cluster://) URL to use for a plain redis:// (rediss://) `url`
    whose server is a Redis Cluster node (`INFO cluster`: cluster_enabled:1); None for any other
    URL, and for a server that does not answer within a few seconds (asked again next time).
    Raises ValueError for a cluster node URL that names a database other than 0."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in PLAIN_SCHEMES:
        return None
    if url not in _probed:
        # without the URL's database: a cluster node refuses SELECT
        is_node = _probe_cluster_enabled(parts._replace(path="").geturl(),
                                         (kwargs or {}).get("socket_connect_timeout"))
        if is_node is None:
            return None
        _probed[url] = is_node
        if is_node:
            log.info("%s is a Redis Cluster node: using it as a cluster", redact_url(url))
    if not _probed[url]:
        return None
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"{redact_url(url)} is a Redis Cluster node, which has only database 0: "
                         f"drop {parts.path!r} from the URL")
    return f"{PLAIN_SCHEMES[scheme]}://{parts.netloc}" + (f"?{parts.query}" if parts.query else "")


def _probe_cluster_enabled(url: str, connect_timeout: float | None) -> bool | None:
    """INFO cluster's cluster_enabled of the Redis at `url`; None if it cannot say now. A Redis that
    refuses INFO (an ACL, a managed Redis's renamed command) counts as no cluster node."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    timeout = min(connect_timeout or PROBE_TIMEOUT_S, PROBE_TIMEOUT_S)
    options = {"socket_connect_timeout": timeout, "socket_timeout": timeout, "retry": Retry(NoBackoff(), 0),
               "health_check_interval": 0}
    try:
        # _connect: the client's own credentials (the URL's, else the environment's password)
        with _connect(url, options, redis.Redis, None, None) as probe:
            info = probe.info("cluster")
    except ResponseError:
        return False
    except REDIS_FAILURES as exc:
        log.debug("could not ask %s whether it is a cluster node: %s", redact_url(url), exc)
        return None
    return str(info.get("cluster_enabled", 0)) == "1"


def _lost_is_connection_error(base: type, url: str = "", moved: bool = True) -> type:
    """`base` (a redis.asyncio connection class) whose sends on a connection Redis has just closed
    raise ConnectionError. uvloop reports them as RuntimeError ("... the handler is closed"), which
    every retry loop would take for a bug: after a Redis restart it once ended the gateway's token
    reader, and a worker loop would crash the same way. With `moved` (a plain client), a MOVED
    reply (`url` names a cluster node) raises ClusterNodeError, which says what to do. A send on a
    connection that another task closed meanwhile is a ConnectionError too (below)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    shown = redact_url(url) if url else "the Redis URL"

    class LostIsConnectionError(base):  # type: ignore[misc, valid-type]
        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            try:
                await super().send_packed_command(command, check_health)
            except RuntimeError as exc:
                if "handler is closed" not in str(exc):
                    raise
                await self.disconnect(nowait=True)
                raise RedisConnectionError(f"connection to Redis lost: {exc}") from exc
            except AttributeError as exc:
                # Closed by another task while this one was sending: the cluster client disconnects
                # every connection of a node, in use or not, when a command on it fails (a failover),
                # and the send then finds no writer ("'NoneType' object has no attribute 'writelines'").
                if getattr(self, "_writer", None) is not None:
                    raise
                raise RedisConnectionError(f"connection to Redis lost: {exc}") from exc

        async def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return await super().read_response(*args, **kwargs)
            except MovedError as exc:
                if not moved:  # a cluster client follows it
                    raise
                raise ClusterNodeError(
                    f"{shown} is a Redis Cluster node (MOVED {exc.slot_id} {exc.host}:{exc.port}); restart "
                    f"this process to use it as a cluster, or give a redis+cluster:// URL") from exc

    LostIsConnectionError.__name__ = LostIsConnectionError.__qualname__ = f"LostIsConnectionError{base.__name__}"
    return LostIsConnectionError


def connect_sync(url: str, **kwargs: Any) -> Any:
    """`connect` for synchronous code (`redis.Redis` or `redis.RedisCluster`)."""
    import redis
    from redis import sentinel

    url = cluster_url_of_node(url, kwargs) or url
    return _connect(url, kwargs, redis.Redis, redis.RedisCluster, sentinel.Sentinel)


PASSWORD_ENV = "BATON_REDIS_PASSWORD"


def _connect(url: str, kwargs: dict[str, Any], redis_class: Any, cluster_class: Any, sentinel_class: Any) -> Any:
    scheme = urlsplit(url).scheme.lower()
    password = os.environ.get(PASSWORD_ENV, "").rstrip("\r\n")
    if password and "password" not in kwargs:  # the URL's options, applied after kwargs, win
        kwargs = {**kwargs, "password": password}
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
