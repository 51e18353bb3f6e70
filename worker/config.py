"""The worker's settings: batching, Spark, poison handling, on top of the shared ones.

Every field is also a ``KEYQ_<FIELD>`` environment variable, like the shared settings.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from keyq.broker.settings import Settings


class WorkerSettings(Settings):
    """What a worker daemon needs beyond the connection settings."""

    spark_master: str = Field(
        default="local[*]", description="Spark master URL (local[*], spark://host:7077, yarn, …)"
    )
    spark_remote: str | None = Field(
        default=None, description="Spark Connect URL (sc://host:15002); wins over spark_master"
    )
    spark_shuffle_partitions: int = Field(
        default=1,
        ge=1,
        description="partitions of each batch's keyed fold; 1 means no shuffle at all",
    )

    spark_driver_java_options: str = Field(
        default="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        description=(
            "JVM options of the worker's Spark driver: a quick compiler and a single-threaded "
            "GC suit many small jobs and leave CPU to the broker and producers"
        ),
    )

    batch_max_events: int = Field(default=5000, ge=1, description="events per micro-batch")
    batch_max_ms: int = Field(
        default=250, ge=1, description="longest wait for a batch to fill, from its first event"
    )
    prefetch: int = Field(default=1000, ge=1, le=65535, description="unacked events per queue")
    max_held_queues: int = Field(
        default=1000, ge=1, le=2000, description="most queues one worker holds (a channel each)"
    )

    sequence_gap_timeout_ms: int = Field(
        default=60_000,
        ge=1,
        description=(
            "how long an event waits, unacked, for an earlier seq of its key and producer "
            "before that gap is given up (reported, and a late arrival dead-lettered)"
        ),
    )

    max_attempts: int = Field(
        default=3, ge=1, description="tries of a failing event before it is dead-lettered"
    )
    retry_backoff_ms: int = Field(default=200, ge=0, description="first retry delay, doubled")

    tick_ms: int = Field(
        default=250, ge=10, description="how often locks are renewed and claims reconsidered"
    )
    scan_interval_ms: int = Field(
        default=1000, ge=10, description="full registry scan, a fallback to announcements"
    )
    idle_release_ms: int = Field(
        default=10_000, ge=10, description="key mode: release a queue idle this long"
    )
    shutdown_timeout: float = Field(
        default=30.0, gt=0, description="SIGTERM: longest wait for the batch in flight, s"
    )

    @model_validator(mode="after")
    def _renew_well_within_ttl(self) -> WorkerSettings:
        if self.tick_ms * 3 > self.lock_ttl_ms:
            raise ValueError(
                "tick_ms must be at most a third of lock_ttl_ms, or locks could expire "
                "between two renewals"
            )
        return self
