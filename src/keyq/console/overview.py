"""What the console's overview shows of every stream, read from Redis alone so that its cost does
not grow with the number of queues: per stream a handful of counts and the figures its leading
janitor last measured (``broker.stream_figures``: depth, dead letters, oldest waiting event),
and each live worker's heartbeat report. Events/s come from the growth of the workers' applied
counters between two reads, as ``keyq status --watch`` computes them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from keyq.broker.clock import now_ms
from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.errors import KeyqError
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.stream_figures import parse_figures
from keyq.broker.stream_policy import StreamPolicies
from keyq.broker.streams import StreamConfig, discover_streams
from keyq.broker.text import as_text
from keyq.broker.worker_report import WorkerReport

STREAMS_CACHED_S = 10.0  # the list of streams is a SCAN of Redis: read it this often at most
RATE_MEMORY_S = 120.0  # readings older than this are not used for a rate
SAMPLE = 10  # parked and stranded keys named on the overview, each linked to its page


@dataclass
class _Reading:
    at_ms: int
    events: dict[str, int] = field(default_factory=dict)  # worker -> applied events


class Overview:
    """Reads the overview; keeps the previous reading of each stream for its events/s."""

    def __init__(self, client: redis.Redis, member_ttl_ms: int, streams: list[str]) -> None:
        self._client = client
        self._ttl_ms = member_ttl_ms
        self._fixed = streams
        self._streams: list[str] = []
        self._streams_at = 0.0
        self._previous: dict[str, _Reading] = {}
        self._rates: dict[str, float | None] = {}
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()

    def streams(self) -> list[str]:
        """The streams shown: those given, else every stream in Redis, looked for by one
        request at a time at most every ``STREAMS_CACHED_S`` (a SCAN of the keyspace)."""
        if self._fixed:
            return self._fixed
        with self._scan_lock:
            if time.monotonic() - self._streams_at > STREAMS_CACHED_S or not self._streams:
                self._streams = discover_streams(self._client)
                self._streams_at = time.monotonic()
            return self._streams

    def read(self) -> dict[str, Any]:
        """Every stream's row and its live workers, as JSON-ready data."""
        now = now_ms()
        rows = []
        for stream in self.streams():
            try:
                row = self._stream(stream, now)
            except (KeyqError, ValueError) as exc:  # one stream's bad record hides no other
                row = {"stream": stream, "error": str(exc)}
            if row is not None:
                rows.append(row)
        return {"at_ms": now, "streams": rows}

    def _stream(self, stream: str, now: int) -> dict[str, Any] | None:
        keys = StreamKeys(stream)
        pipe = self._client.pipeline(transaction=False)
        pipe.get(keys.config)
        pipe.zcard(keys.registry)
        pipe.zscore(keys.registry, dead_letter_queue_name(stream))
        pipe.hlen(keys.paused_keys)
        pipe.hlen(keys.parked_keys)
        pipe.hlen(keys.stranded)
        pipe.get(keys.figures)
        pipe.get(keys.janitor_lease)
        pipe.zrangebyscore(keys.members, now, "+inf", withscores=True)
        pipe.hgetall(keys.member_info)
        pipe.hscan(keys.parked_keys, 0, count=SAMPLE)
        pipe.hscan(keys.stranded, 0, count=SAMPLE)
        raw_config, registered, dlq_registered, paused, parked, stranded, *rest = pipe.execute()
        raw_figures, janitor, members, infos, (_, parked_some), (_, stranded_some) = rest
        if raw_config is None:
            return None  # its config went (the stream was removed) since the SCAN
        config = StreamConfig.from_json(stream, str(raw_config))
        policy = StreamPolicies(self._client, stream).load()
        letters, _messages = DeadLetterIndex(self._client, stream).counts()
        workers = [
            self._worker(stream, as_text(worker), int(expiry), infos, now)
            for worker, expiry in members
        ]
        measured = parse_figures(raw_figures)
        figures = measured.figures if measured else None
        return {
            "stream": stream,
            "mode": config.mode.value,
            "buckets": config.buckets,
            "queue_type": config.queue_type,
            "queues": int(registered) - (dlq_registered is not None),
            "depth": None if figures is None else figures.ready_events,
            "dead_letters": letters,
            "dead_letters_ready": None if figures is None else figures.dead_letters,
            "oldest_waiting_s": None if figures is None else figures.oldest_event_age_s,
            "paused_keys": int(paused),
            "parked_keys": int(parked),
            "stranded_keys": int(stranded),
            "parked_sample": sorted(as_text(key) for key in parked_some)[:SAMPLE],
            "stranded_sample": sorted(as_text(key) for key in stranded_some)[:SAMPLE],
            "stream_paused": policy.paused,
            "poison_policy": policy.poison_policy,
            "rate_limit": policy.rate_limit,
            "dedupe_window_s": policy.dedupe_window_s,
            "events_per_s": self._rate(stream, now, workers),
            "workers": workers,
            "janitor": {
                "leader": None if janitor is None else as_text(janitor).split("|")[0],
                "measured_ms_ago": None if measured is None else max(0, now - measured.at_ms),
            },
        }

    def _worker(
        self, stream: str, worker: str, expiry: int, infos: dict[Any, Any], now: int
    ) -> dict[str, Any]:
        report = WorkerReport.parse(infos.get(worker), worker=worker, stream=stream)
        where = None
        if report is not None and report.host:
            where = f"{report.host}:{report.pid}" if report.pid else report.host
        return {
            "worker": worker,
            "where": where,
            "heartbeat_age_ms": max(0, now - (expiry - self._ttl_ms)),
            "held": None if report is None else report.held,
            "batches": None if report is None else report.batches,
            "events": None if report is None else report.events,
            "dead_lettered": None if report is None else report.dead_lettered,
            "spark_seconds": None if report is None else round(report.spark_seconds, 1),
            "ready": report is not None and report.ready,
        }

    def _rate(self, stream: str, now: int, workers: list[dict[str, Any]]) -> float | None:
        """Events/s applied since the previous reading, from the workers seen in both."""
        current = _Reading(now, {w["worker"]: w["events"] for w in workers if w["events"]})
        with self._lock:
            before = self._previous.get(stream)
            if before is None or now - before.at_ms > RATE_MEMORY_S * 1000:
                self._previous[stream] = current
                return None
            if now - before.at_ms < 1000:
                return self._rates.get(stream)  # too close to the last reading: its rate
            self._previous[stream] = current
        grown = [
            count - before.events[worker]
            for worker, count in current.events.items()
            if worker in before.events and count >= before.events[worker]
        ]
        rate = round(sum(grown) / ((now - before.at_ms) / 1000), 1) if grown else None
        if not grown and (current.events or before.events):
            rate = 0.0
        with self._lock:
            self._rates[stream] = rate
        return rate
