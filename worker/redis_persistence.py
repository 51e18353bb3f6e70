"""Whether Redis keeps what keyq commits across a restart, said once when a worker starts.

Keyed state and exactly-once marks live in Redis, and a batch's messages are acked once its
commit is there. A Redis without AOF forgets commits on restart: all of them without RDB save
points, those since the last snapshot with them. The acked events' effects are then gone, and
events delivered or sent again are applied again. Managed Redis often refuses ``CONFIG GET``;
then only ``INFO persistence`` is known, and the worker says so without guessing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import redis
import redis.exceptions

ADVICE = (
    "set 'appendonly yes' (with 'appendfsync everysec', or 'always' where the last second "
    "of commits matters) in the Redis configuration; see docs/operations.md"
)


@dataclass(frozen=True)
class Persistence:
    """What Redis reports: AOF on or off, its RDB save points ("" for none) and fsync policy
    (None where ``CONFIG GET`` was refused)."""

    aof: bool
    save_points: str | None
    appendfsync: str | None


def read_persistence(client: redis.Redis) -> Persistence:
    """``INFO persistence``, and ``CONFIG GET`` where allowed. Raises RedisError if even INFO
    is refused (a proxy, an ACL)."""
    info = client.info("persistence")
    aof = str(info.get("aof_enabled", "0")) == "1"
    return Persistence(aof, _config(client, "save"), _config(client, "appendfsync"))


def judge(persistence: Persistence) -> tuple[int, str]:
    """(log level, message) for a worker to log once at start."""
    if persistence.aof:
        return logging.INFO, f"Redis persistence: AOF, appendfsync {persistence.appendfsync or '?'}"
    if persistence.save_points == "":
        return logging.WARNING, (
            "Redis keeps nothing on disk (aof_enabled:0, no RDB save points): a Redis restart "
            "forgets keyed state and exactly-once marks, and events are then applied again; "
            + ADVICE
        )
    if persistence.save_points is None:
        return logging.INFO, (
            "Redis does not use AOF and its RDB save points could not be read (CONFIG GET "
            "refused): unless it snapshots, a restart forgets keyed state and exactly-once "
            "marks; " + ADVICE
        )
    return logging.WARNING, (
        f"Redis persists by RDB snapshots only (save {persistence.save_points!r}): a Redis "
        "crash forgets the commits since the last snapshot, whose events were already acked; "
        + ADVICE
    )


def log_redis_persistence(client: redis.Redis, log: logging.Logger) -> None:
    """Log one line on how Redis persists keyq's commits (a warning when it would lose them);
    never raises, as a worker must start whatever Redis lets it read."""
    try:
        persistence = read_persistence(client)
    except (redis.exceptions.RedisError, OSError) as exc:
        log.info("could not read how Redis persists (INFO persistence failed): %s", exc)
        return
    level, message = judge(persistence)
    log.log(level, message)


def _config(client: redis.Redis, name: str) -> str | None:
    try:
        found = cast(dict[Any, Any], client.config_get(name))
    except redis.exceptions.ResponseError:  # CONFIG refused or renamed (managed Redis, ACLs)
        return None
    value = found.get(name, found.get(name.encode()))  # str or bytes, as the client decodes
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return None if value is None else str(value)
