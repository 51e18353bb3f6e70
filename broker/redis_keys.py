"""Every Redis key keyq uses, in one place.

All keys of a stream share the hash tag ``{stream}`` so that multi-key scripts and pipelines
stay in one slot of a Redis Cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

KEY_PREFIX = "keyq"
# List: the newest actions taken from `keyq console` first (who, what, when), trimmed.
CONSOLE_AUDIT = f"{KEY_PREFIX}:console:audit"


@dataclass(frozen=True)
class StreamKeys:
    """The Redis key names of one stream."""

    stream: str

    @property
    def _base(self) -> str:
        return f"{KEY_PREFIX}:{{{self.stream}}}"

    @property
    def config(self) -> str:
        """String: the stream's JSON config (mode, buckets), set once."""
        return f"{self._base}:config"

    @property
    def registry(self) -> str:
        """Sorted set: queue name -> last activity (ms since epoch)."""
        return f"{self._base}:queues"

    @property
    def queue_keys(self) -> str:
        """Hash: key-mode queue name -> the original key (digest names hide it)."""
        return f"{self._base}:queue-keys"

    @property
    def woken(self) -> str:
        """Sorted set: queue name -> when a producer published to it again after it had been
        quiet (ms since epoch), so that workers claim it within a tick without probing."""
        return f"{self._base}:woken"

    @property
    def announcements(self) -> str:
        """Pub/sub channel: names of newly declared queues, for workers to claim at once."""
        return f"{self._base}:announce"

    @property
    def members(self) -> str:
        """Sorted set: worker id -> membership expiry (ms since epoch)."""
        return f"{self._base}:workers"

    @property
    def member_info(self) -> str:
        """Hash: worker id -> JSON description (host, pid, started)."""
        return f"{self._base}:worker-info"

    @property
    def fence_tokens(self) -> str:
        """Counter: the last fencing token issued for any of the stream's queues (never reset,
        so no lock value is ever issued twice, whatever the janitor deletes)."""
        return f"{self._base}:fence"

    @property
    def incarnations(self) -> str:
        """Hash: base queue name -> its current incarnation (absent: 0, the base name)."""
        return f"{self._base}:incarnations"

    def lock(self, queue: str) -> str:
        """String: ``owner|token`` of the worker holding ``queue``, with a ttl."""
        return f"{self._base}:lock:{queue}"

    def retiring(self, queue: str) -> str:
        """String with a ttl: ``queue`` is being deleted; producers must not publish to it."""
        return f"{self._base}:retiring:{queue}"

    def producer(self, producer_id: str) -> str:
        """String with a ttl: a producer instance that is still running (``producer_presence``)."""
        return f"{self._base}:producer:{producer_id}"

    @property
    def lock_prefix(self) -> str:
        return f"{self._base}:lock:"

    @property
    def state(self) -> str:
        """Hash: key -> JSON keyed state, as folded by pipelines."""
        return f"{self._base}:state"

    @property
    def marks(self) -> str:
        """Hash: key -> JSON of the highest seq applied per producer (exactly-once marks)."""
        return f"{self._base}:marks"

    @property
    def sink_pending(self) -> str:
        """Hash: sink batch token -> staged output committed but not yet made visible."""
        return f"{self._base}:sink-pending"

    @property
    def commits(self) -> str:
        """Counter every commit that waits for replicas bumps (a write for ``WAIT``)."""
        return f"{self._base}:commits"

    @property
    def paused_keys(self) -> str:
        """Hash: key -> when an operator paused it (ms since epoch)."""
        return f"{self._base}:paused"

    @property
    def parked_keys(self) -> str:
        """Hash: key -> JSON of the poison event it is parked at (``key_control.ParkedKey``)."""
        return f"{self._base}:parked"

    @property
    def aside(self) -> str:
        """Hash: key -> JSON list of the queues its events wait in, drained head first, before
        any of its events in its own queue (``key_control``)."""
        return f"{self._base}:aside"

    @property
    def policy(self) -> str:
        """Hash: the stream's operator settings (poison policy, rate limit, paused)."""
        return f"{self._base}:policy"

    def dedupe_ids(self, key_digest: str, bucket: int) -> str:
        """Hash with a ttl: dedupe id -> ``producer:seq`` of the event applied under it, for
        one key (by digest) and one window-long time bucket."""
        return f"{self._base}:dedupe:{bucket}:{key_digest}"

    @property
    def redrives(self) -> str:
        """Hash: redrive queue -> key, recorded before the queue is declared, so that a queue
        a killed redrive left behind is found and deleted by the next one."""
        return f"{self._base}:redrives"

    @property
    def redrive_lock(self) -> str:
        """String with a ttl: the redrive or drop working through the dead-letter queue."""
        return f"{self._base}:dlq-lock"

    @property
    def dead_letter_index_prefix(self) -> str:
        """The start of every key of the index of dead letters (``broker.dead_letter_index``):
        ``by-time`` (sorted set: entry -> dead at in ms, plus its order of indexing within that
        ms as a fraction), ``by-id`` (sorted set, all scores 0: entries by letter id, read by
        lex range), ``rows`` and ``details`` (hashes: entry -> JSON summary / headers and
        payload), ``copies`` and ``added`` (hashes: entry -> copies in the queue / when first
        indexed, Redis time ms), ``reasons`` (hash: reason digest -> reason), ``counts`` (hash:
        letters, messages, order), ``key:<digest>`` and ``reason:<digest>`` (sorted sets: one
        key's / one reason's entries by time)."""
        return f"{self._base}:dlq-index:"

    def dead_letter_index(self, part: str) -> str:
        """One key of the index of dead letters: ``part`` as listed above."""
        return f"{self.dead_letter_index_prefix}{part}"

    @property
    def stranded(self) -> str:
        """Hash with a ttl: key (or queue) -> JSON of why its waiting events make no progress,
        as the janitor's watchdog last found them (``broker.stranded``)."""
        return f"{self._base}:stranded"

    @property
    def figures(self) -> str:
        """String with a ttl: JSON of the stream's figures as its leading janitor last measured
        them (``broker.stream_figures``)."""
        return f"{self._base}:figures"

    @property
    def routes(self) -> str:
        """Hash, auto mode: promoted key -> its route (JSON, ``broker.routes``); a key not in it
        is in its bucket."""
        return f"{self._base}:routes"

    @property
    def moves(self) -> str:
        """Hash, auto mode: promoted key -> its bucket queue, while the move is open (the
        bucket's holder has not closed it yet)."""
        return f"{self._base}:moves"

    def forwarded(self, key: str) -> str:
        """Hash with a ttl, auto mode: producer -> the highest seq of ``key``'s events from it
        that its bucket's holder forwarded to the key's own queue."""
        return f"{self._base}:forwarded:{key}"

    @property
    def route_epoch(self) -> str:
        """Counter: each promotion's epoch; only grows, never reset."""
        return f"{self._base}:route-epoch"

    @property
    def route_counts(self) -> str:
        """Hash: promotions by why, and demotions, since the stream began."""
        return f"{self._base}:route-counts"

    @property
    def route_log(self) -> str:
        """List: the latest promotions, closes and demotions (JSON), newest first."""
        return f"{self._base}:route-log"

    @property
    def janitor_lease(self) -> str:
        return f"{self._base}:janitor"

    def all_patterns(self) -> list[str]:
        """Glob patterns matching every key of the stream, for cleanup and inspection."""
        return [f"{KEY_PREFIX}:{{{self.stream}}}:*"]
