"""The janitor's settings, on top of the shared ones (each also ``KEYQ_<FIELD>``, in the
environment or ``.env``)."""

from __future__ import annotations

from pydantic import Field

from keyq.broker.settings import Settings


class JanitorSettings(Settings):
    """How eagerly and how fast the janitor reclaims idle queues."""

    idle_ttl_s: float = Field(
        default=60.0, ge=0, description="a queue idle this long (and drained, unheld) goes"
    )
    janitor_interval_s: float = Field(default=5.0, gt=0, description="pause between passes")
    janitor_batch: int = Field(default=20_000, ge=1, description="idle queues read per pass")
    janitor_chunk: int = Field(
        default=2500, ge=1, description="queues marked, then deleted, together within a pass"
    )
    janitor_connections: int = Field(
        default=4, ge=1, le=32, description="AMQP connections deleting in parallel"
    )
    janitor_lease_ms: int = Field(
        default=30_000, ge=1000, description="leadership lease of a stream's janitor"
    )
    # prometheus_url and management_url (the queue list, for queues a crash left
    # unregistered; with neither, that step is skipped) and fd_warn_ratio are shared
    # settings: keyq status reads them too.
    stranded_after_s: float = Field(
        default=60.0,
        gt=0,
        description="a key whose waiting events make no progress this long is reported "
        "stranded by the watchdog (a key whose queue is gone with events aside is repaired "
        "at once)",
    )
    fd_warn_every_s: float = Field(
        default=600.0,
        gt=0,
        description="repeat the warning about the broker's file descriptors this often while "
        "they stay near the limit",
    )
