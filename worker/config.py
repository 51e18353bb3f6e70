"""The worker's settings: batching, Spark, poison handling, on top of the shared ones.

Every field is also a ``KEYQ_<FIELD>`` environment variable (or ``.env`` entry), like the
shared settings.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from keyq.broker.settings import Settings


def spark_options(value: str | None) -> dict[str, str]:
    """``KEYQ_SPARK_CONF`` as a dict: ``key=value`` entries separated by commas."""
    options: dict[str, str] = {}
    for entry in (value or "").split(","):
        if not entry.strip():
            continue
        name, sep, setting = entry.partition("=")
        if not sep or not name.strip().startswith("spark."):
            raise ValueError(
                f"KEYQ_SPARK_CONF entry {entry.strip()!r} must be spark.<name>=<value>"
            )
        options[name.strip()] = setting.strip()
    return options


class WorkerSettings(Settings):
    """What a worker daemon needs beyond the connection settings."""

    spark_master: str = Field(
        default="local[*]", description="Spark master URL (local[*], spark://host:7077, yarn, …)"
    )
    spark_remote: str | None = Field(
        default=None, description="Spark Connect URL (sc://host:15002); wins over KEYQ_SPARK_MASTER"
    )
    spark_conf: str | None = Field(
        default=None,
        description="more Spark settings, comma-separated key=value "
        "(spark.driver.host=10.0.0.5,spark.executor.memory=2g), given to the session as is",
    )
    spark_start_timeout_s: float = Field(
        default=180.0,
        gt=0,
        description="how long the first job may wait for executors (a cluster with no free "
        "cores would otherwise hang the worker's start)",
    )
    spark_shuffle_partitions: int = Field(
        default=1,
        ge=1,
        description="partitions of each batch's keyed fold; 1 means no shuffle at all",
    )

    spark_class_cache: str | None = Field(
        default=None,
        description=(
            "folder of the class-data archive that halves a local Spark's start (built by "
            "`keyq spark-cache`); default ~/.cache/keyq, 'off' to start without"
        ),
    )
    spark_driver_java_options: str = Field(
        default="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        description=(
            "JVM options of the worker's Spark driver: a quick compiler and a single-threaded "
            "GC suit many small jobs and leave CPU to the broker and producers"
        ),
    )

    @field_validator("spark_conf")
    @classmethod
    def _spark_conf(cls, value: str | None) -> str | None:
        spark_options(value)  # a malformed entry fails at start, not at the first batch
        return value or None

    batch_max_events: int = Field(default=5000, ge=1, description="events per micro-batch")
    batch_max_ms: int = Field(
        default=0,
        ge=0,
        description="wait for a batch to fill, from its first event, under light load; 0 "
        "starts a batch as soon as events are ready and the previous job has ended",
    )
    prefetch: int = Field(
        default=1000,
        ge=1,
        le=65535,
        description="unacked events per queue (its AMQP prefetch starts at KEYQ_PREFETCH / "
        "KEYQ_PACK_MAX_EVENTS messages, since a message may be a pack of events, and is "
        "fitted to the size its messages have; a queue backed up beyond it may be widened, "
        "KEYQ_PREFETCH_WIDEN_EVENTS)",
    )
    prefetch_widen_events: int = Field(
        default=10_000,
        ge=0,
        description="events that queues backed up beyond KEYQ_PREFETCH may hold beyond it, "
        "for the whole worker: such a queue is widened to up to a batch while batches have "
        "room to spare (not an auto-mode bucket); 0 turns widening off",
    )
    max_held_queues: int | None = Field(
        default=None,
        ge=1,
        description="most queues one worker holds; unset: as many as its connection has "
        "channels for (one each: 2,047 on RabbitMQ's defaults, less the few keyq keeps)",
    )

    sequence_gap_timeout_ms: int = Field(
        default=60_000,
        ge=1,
        description=(
            "how long an event waits, unacked, for an earlier seq of its key and producer "
            "before that gap is given up (reported, and a late arrival dead-lettered)"
        ),
    )

    auto_promote_rate: float = Field(
        default=200.0,
        gt=0,
        description="auto mode: a key published at this many events a second (by its events' "
        "publish times) and taken from its bucket while that is at most 0.5 s behind (or "
        "its events are slow to apply, 0.5 ms each or more) is promoted to a queue of its own",
    )
    auto_promote_backlog: int = Field(
        default=1000,
        ge=1,
        description="auto mode: a key with this many events in one batch from its bucket is "
        "promoted to a queue of its own",
    )

    auto_key_batch_max: int = Field(
        default=200,
        ge=1,
        description="auto mode: most events of a promoted key in a batch it shares with other "
        "queues until its events' cost is known (or as many as the others have, if more), and "
        "the least after (then: as many as fill 0.25 s of Spark), so that a hot, slow key "
        "cannot make the batches of its worker long for the keys of the buckets it holds (a "
        "key's events apply one after another anyway)",
    )

    max_attempts: int = Field(
        default=3, ge=1, description="tries of a failing event before it is dead-lettered"
    )
    retry_backoff_ms: int = Field(
        default=200,
        ge=0,
        description="first retry delay, doubled each retry (jittered, at most 10 s)",
    )

    tick_ms: int = Field(
        default=250,
        ge=10,
        description="how often locks are renewed and claims reconsidered (at most a third of "
        "KEYQ_LOCK_TTL_MS)",
    )
    scan_interval_ms: int = Field(
        default=1000, ge=10, description="full registry scan, a fallback to announcements"
    )
    idle_release_ms: int = Field(
        default=10_000,
        ge=10,
        description="key mode: release a queue idle this long, and claim one idle longer only "
        "once a look finds messages in it; bucket mode: look into a quorum queue quiet this "
        "long (is the broker holding its messages back?)",
    )
    shutdown_timeout: float = Field(
        default=30.0, gt=0, description="SIGTERM: longest wait for the batch in flight, s"
    )

    @model_validator(mode="after")
    def _renew_well_within_ttl(self) -> WorkerSettings:
        if self.tick_ms * 3 > self.lock_ttl_ms:
            raise ValueError(
                "KEYQ_TICK_MS must be at most a third of KEYQ_LOCK_TTL_MS, or locks could "
                "expire between two renewals"
            )
        return self
