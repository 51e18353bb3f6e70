"""Settings shared by every keyq component, read from ``KEYQ_*`` environment variables and,
below them, from a ``.env`` file in the working directory.

Defaults favour fast failover (short heartbeats and lock ttls) over the minute-long defaults
of AMQP clients, because a crashed worker's keys should move within seconds.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from keyq.broker.errors import ConfigurationError
from keyq.broker.redis_topology import parse_redis_url
from keyq.broker.urls import (
    AMQP_SCHEMES,
    HTTP_SCHEMES,
    REDIS_SCHEMES,
    check_url,
    check_urls,
    redact_url,
    split_urls,
)

DEFAULT_AMQP_URL = "amqp://guest:guest@localhost:5672/%2F"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
ENV_PREFIX = "KEYQ_"
ENV_FILE = ".env"  # in the working directory; the environment wins over it


def env_name(field: str) -> str:
    """The environment variable of a settings field: what people set, so what errors name."""
    return f"{ENV_PREFIX}{field.upper()}"


class Settings(BaseSettings):
    """Connection and tuning settings; every field is also ``KEYQ_<FIELD>`` in the env, or in
    ``.env`` in the working directory (the environment wins)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_file=ENV_FILE, extra="ignore", frozen=True
    )

    amqp_url: str = Field(
        default=DEFAULT_AMQP_URL,
        repr=False,
        description="RabbitMQ (amqps:// for TLS), or a cluster's nodes comma-separated: each "
        "connection takes the next, so a reconnect after a lost node goes to another",
    )
    redis_url: str = Field(
        default=DEFAULT_REDIS_URL,
        repr=False,
        description="Redis (rediss:// for TLS), a Redis Cluster (redis+cluster://host:7000,"
        "host:7001) or a primary under Sentinel (redis+sentinel://host:26379,host:26380/service)",
    )
    redis_min_replicas: int | None = Field(
        default=None,
        ge=0,
        le=16,
        description="replicas that must have a commit before its events are acked (WAIT); "
        "unset: 1 if the stream's Redis primary has a replica when the worker starts, else 0",
    )
    redis_replica_timeout_ms: int = Field(
        default=2000,
        ge=1,
        description="how long a commit waits for its replicas before its batch is retried",
    )
    management_url: str | None = Field(
        default=None,
        repr=False,
        description="RabbitMQ management API (http://user:pass@host:15672): the broker's "
        "file descriptor use (status, janitor) and queues a crash left unregistered (janitor)",
    )
    # One URL per node of the broker, comma-separated: each node serves only its own queues'
    # figures and its own file descriptors (broker/prometheus_api.py).
    prometheus_url: str | None = Field(
        default=None,
        repr=False,
        description="RabbitMQ's rabbitmq_prometheus listener on each node "
        "(http://host:15692, comma-separated): queue depths and consumers (status), file "
        "descriptors (status, janitor), queues a crash left unregistered (janitor); read "
        "before KEYQ_MANAGEMENT_URL, and the only source where RabbitMQ 4.x has the management "
        "metrics collection off",
    )

    amqp_heartbeat: int = Field(
        default=5, ge=1, le=600, description="AMQP heartbeat, s: a dead peer is noticed in seconds"
    )
    connect_timeout: float = Field(
        default=5.0,
        gt=0,
        description="a TCP connect, s; a whole connection attempt (AMQP handshake included) "
        "gets twice this",
    )
    reconnect_timeout: float = Field(
        default=300.0,
        ge=0,
        description="how long a producer retries a lost broker, s: long enough to outlive a "
        "node restart and a rolling upgrade (docs/operations.md)",
    )

    max_message_bytes: int = Field(
        default=1_048_576, ge=1024, le=134_217_728, description="largest message accepted"
    )
    confirm_window: int = Field(default=10_000, ge=1, description="unconfirmed events in flight")
    pack_max_events: int = Field(
        default=20,
        ge=1,
        le=10_000,
        description=(
            "most events of one queue a producer sends as one message (a pack) when they wait "
            "together; 1 = every event a message of its own. Workers size their AMQP prefetch "
            "as KEYQ_PREFETCH / KEYQ_PACK_MAX_EVENTS messages: set it alike on both"
        ),
    )
    pack_max_bytes: int = Field(
        default=262_144,
        ge=1024,
        le=134_217_728,
        description="most bytes of one pack (KEYQ_MAX_MESSAGE_BYTES if that is less)",
    )
    pack_linger_ms: float = Field(
        default=0.0,
        ge=0,
        le=10_000,
        description=(
            "how long an event may wait for others of its queue to join its pack; 0 = a lone "
            "event goes at once (packs form only from events already waiting)"
        ),
    )
    publish_timeout: float = Field(
        default=30.0, gt=0, description="how long publish waits under backpressure, s"
    )
    confirm_timeout: float = Field(
        default=15.0,
        gt=0,
        description=(
            "an event unconfirmed this long makes the producer reconnect (to the next node) "
            "and send again everything unconfirmed, s"
        ),
    )

    queue_type: Literal["classic", "quorum"] | None = Field(
        default=None,
        description=(
            "type of a new stream's queues (classic when unset; quorum for RabbitMQ clusters); "
            "fixed at the stream's first use, like its mode"
        ),
    )

    publish_lease_ms: int = Field(
        default=2000, ge=10, description="a producer re-checks a queue's retirement this often"
    )
    retire_grace_ms: int = Field(
        default=5000,
        ge=20,
        description="a deleter waits this long after marking a queue (at least twice "
        "KEYQ_PUBLISH_LEASE_MS)",
    )

    metrics_port: int | None = Field(
        default=None, ge=0, le=65535, description="worker and janitor: serve /metrics on this port"
    )
    metrics_host: str = Field(default="0.0.0.0", description="address the metrics endpoint binds")
    metrics_port_span: int = Field(
        default=1,
        ge=1,
        le=1000,
        description=(
            "how many ports from KEYQ_METRICS_PORT a daemon may take: the first free one, logged "
            "(daemons sharing one network); 1 = that port or a clear error"
        ),
    )

    log_format: Literal["text", "json"] = Field(
        default="text",
        description="daemon logs as text lines, or as one JSON object per line (json) "
        "for log collectors",
    )

    fd_warn_ratio: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="warn when a broker node's open file descriptors reach this share of its "
        "limit (key mode needs about one per queue holding messages)",
    )

    producer_ttl_ms: int = Field(
        default=10_000,
        ge=100,
        description="a producer that has not renewed its presence for this long is taken for "
        "gone: a sequence gap its events left is given up once their queue is drained",
    )

    lock_ttl_ms: int = Field(
        default=4000,
        ge=100,
        description="queue lock ttl: a stalled worker loses its queues after this",
    )
    member_ttl_ms: int = Field(default=4000, ge=100, description="worker membership ttl")

    @field_validator("amqp_url")
    @classmethod
    def _amqp(cls, value: str) -> str:
        return check_urls(value, AMQP_SCHEMES, "KEYQ_AMQP_URL")

    @field_validator("redis_url")
    @classmethod
    def _redis(cls, value: str) -> str:
        if parse_redis_url(value).kind == "server":
            check_url(value, REDIS_SCHEMES, "KEYQ_REDIS_URL")
        return value

    @field_validator("log_format", mode="before")
    @classmethod
    def _log_format(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("management_url")
    @classmethod
    def _management(cls, value: str | None) -> str | None:
        if not value:
            return None  # KEYQ_MANAGEMENT_URL= (empty) means not set
        return check_url(value, HTTP_SCHEMES, "KEYQ_MANAGEMENT_URL")

    @field_validator("prometheus_url")
    @classmethod
    def _prometheus(cls, value: str | None) -> str | None:
        if not value or not split_urls(value):
            return None  # KEYQ_PROMETHEUS_URL= (empty) means not set
        check_urls(value, HTTP_SCHEMES, "KEYQ_PROMETHEUS_URL")
        for url in split_urls(value):
            parts = urlsplit(url)
            if parts.query or parts.fragment or "/metrics" in parts.path:
                raise ConfigurationError(
                    "KEYQ_PROMETHEUS_URL names the rabbitmq_prometheus listener, without a "
                    f"path to its metrics (e.g. http://host:15692); got {redact_url(url)!r}"
                )
        return value

    @model_validator(mode="after")
    def _grace_outlasts_lease(self) -> Settings:
        if self.retire_grace_ms < 2 * self.publish_lease_ms:
            raise ValueError(
                "KEYQ_RETIRE_GRACE_MS must be at least twice KEYQ_PUBLISH_LEASE_MS, or a deleter "
                "could remove a queue a producer still publishes to"
            )
        return self

    def amqp_prefetch(self, events: int) -> int:
        """The AMQP prefetch (messages) that holds at most ``events`` events when every
        message is a pack of up to ``pack_max_events``."""
        return max(1, events // self.pack_max_events)

    def describe(self) -> dict[str, Any]:
        """The settings as shown to people: URLs without passwords."""
        shown = {
            name: "***" if isinstance(value, SecretStr) else value
            for name, value in self.model_dump().items()
        }
        shown["amqp_url"] = redact_url(self.amqp_url)
        shown["redis_url"] = redact_url(self.redis_url)
        if self.management_url:
            shown["management_url"] = redact_url(self.management_url)
        if self.prometheus_url:
            shown["prometheus_url"] = redact_url(self.prometheus_url)
        return shown


SettingsT = TypeVar("SettingsT", bound=Settings)


def load_settings(kind: type[SettingsT] = Settings, **overrides: Any) -> SettingsT:  # type: ignore[assignment]
    """Settings (of ``kind``) from the environment and ``.env``, with explicit non-None
    overrides on top.

    Raises ``ConfigurationError`` naming each bad setting's environment variable (never
    pydantic's error, which would echo the input URL with its password).
    """
    given = {name: value for name, value in overrides.items() if value is not None}
    try:
        return kind(**given)
    except ConfigurationError:
        raise
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_input=False, include_url=False):
            message = str(error["msg"]).removeprefix("Value error, ")
            field = str(error["loc"][0]) if error["loc"] else ""
            # A value given in code is named as in code; one from outside by its variable.
            variable = field if field in given or not field else env_name(field)
            named = not variable or message.startswith(variable)
            problems.append(message if named else f"{variable}: {message}")
        raise ConfigurationError("; ".join(problems)) from None
    except (UnicodeDecodeError, OSError) as exc:
        raise ConfigurationError(f"cannot read the settings file {ENV_FILE}: {exc}") from None
