"""Which Redis a URL names, and a client for it: one server, a Cluster, or Sentinel.

- ``redis://``, ``rediss://``, ``unix://``: one server (redis-py's ``Redis``).
- ``redis+cluster://[user:pass@]host:port[,host:port…]``: a Redis Cluster, found from any of
  the nodes listed (``RedisCluster``). A stream's keys share one hash tag, so each stream
  lives in one slot and every script and pipeline stays on one node.
- ``redis+sentinel://[user:pass@]host:port[,host:port…]/service[/db]``: the primary that the
  sentinels name for ``service``; the client asks them again after a failover.

``rediss+cluster`` and ``rediss+sentinel`` use TLS. Credentials are for the Redis servers;
the sentinels are asked without them.

A cluster client is handed around as ``redis.Redis``: it offers the same commands, and the
few places that need one node's connection (a commit followed by ``WAIT``, ``CLIENT LIST``)
ask ``node_client`` for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast
from urllib.parse import unquote, urlsplit

import redis
import redis.cluster
import redis.sentinel

from keyq.broker.errors import ConfigurationError
from keyq.broker.urls import redact_url

Kind = Literal["server", "cluster", "sentinel"]

_KINDS: dict[str, tuple[Kind, bool]] = {
    "redis": ("server", False),
    "rediss": ("server", True),
    "unix": ("server", False),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}
SCHEMES = tuple(_KINDS)
_DEFAULT_PORT = {"server": 6379, "cluster": 6379, "sentinel": 26379}


@dataclass(frozen=True)
class RedisTarget:
    """What a ``KEYQ_REDIS_URL`` names."""

    kind: Kind
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    username: str | None = None
    password: str | None = None
    tls: bool = False
    service: str | None = None
    db: int = 0


def parse_redis_url(url: str, what: str = "KEYQ_REDIS_URL") -> RedisTarget:
    """Read a Redis URL of any supported kind; errors name the setting, never the password."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _KINDS:
        allowed = ", ".join(f"{s}://" for s in SCHEMES)
        raise ConfigurationError(
            f"{what} must start with one of {allowed}; got {redact_url(url)!r}"
        )
    kind, tls = _KINDS[scheme.lower()]
    if kind == "server":
        return RedisTarget(kind, url, tls=tls)
    location, _, path = rest.partition("/")
    path = path.partition("?")[0].partition("#")[0]
    credentials, at, hosts = location.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = credentials.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = tuple(_node(part, kind, url, what) for part in hosts.split(",") if part.strip())
    if not nodes:
        raise ConfigurationError(f"{what} lists no node: {redact_url(url)!r}")
    parts = [unquote(p) for p in path.split("/") if p]
    service: str | None = None
    if kind == "sentinel":
        if not parts:
            raise ConfigurationError(
                f"{what} must name the sentinel service after the nodes "
                f"(redis+sentinel://host:26379/mymaster); got {redact_url(url)!r}"
            )
        service, parts = parts[0], parts[1:]
    if len(parts) > 1 or (parts and not parts[0].isdigit()):
        raise ConfigurationError(f"{what} has a bad database number: {redact_url(url)!r}")
    db = int(parts[0]) if parts else 0
    if kind == "cluster" and db != 0:
        raise ConfigurationError(f"{what}: a Redis Cluster has database 0 only")
    return RedisTarget(kind, url, nodes, username, password, tls, service, db)


def _node(part: str, kind: Kind, url: str, what: str) -> tuple[str, int]:
    try:
        parsed = urlsplit(f"//{part.strip()}")
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host = port = None
    if not host:
        raise ConfigurationError(f"{what} has a bad node {part.strip()!r}: {redact_url(url)!r}")
    return host, port or _DEFAULT_PORT[kind]


def connect(target: RedisTarget, **options: Any) -> redis.Redis:
    """A client for ``target``; ``options`` are redis-py connection options (timeouts,
    ``client_name``, ``decode_responses``…)."""
    if target.kind == "server":
        return redis.Redis.from_url(target.url, **options)
    auth: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.tls:
        auth["ssl"] = True
    if target.kind == "cluster":
        options.pop("health_check_interval", None)
        cluster = redis.cluster.RedisCluster(
            startup_nodes=[
                redis.cluster.ClusterNode(host, port)  # type: ignore[no-untyped-call]
                for host, port in target.nodes
            ],
            **auth,
            **options,
        )
        return cast(redis.Redis, cluster)
    assert target.service is not None
    asking: dict[str, Any] = {
        key: options[key] for key in ("socket_timeout", "socket_connect_timeout") if key in options
    }
    # redis-py 8.2 and later type these calls, earlier releases do not
    sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        list(target.nodes), sentinel_kwargs=asking, db=target.db, **auth, **options
    )
    primary: redis.Redis = sentinel.master_for(target.service)  # type: ignore[no-untyped-call, unused-ignore]
    return primary


def is_cluster(client: redis.Redis) -> bool:
    return isinstance(client, redis.cluster.RedisCluster)


def node_client(client: redis.Redis, key: str) -> redis.Redis:
    """A client whose commands all go to the one server that holds ``key`` (a cluster's
    primary for its slot; the client itself otherwise). Needed where a command must share a
    connection with the writes before it (``WAIT``) or must ask that server (``CLIENT
    LIST``)."""
    if isinstance(client, redis.cluster.RedisCluster):
        node = client.get_node_from_key(key)
        return client.get_redis_connection(node)
    return client


def connected_replicas(client: redis.Redis, key: str) -> int:
    """How many replicas the primary holding ``key`` has connected now."""
    info = node_client(client, key).info("replication")
    return int(info.get("connected_slaves", 0))
