"""``keyq produce``: synthetic keyed load, for trying a deployment and for benchmarks."""

from __future__ import annotations

import random
import string
import time
from dataclasses import dataclass
from typing import Any

from keyq.producer import Producer


@dataclass(frozen=True)
class Load:
    stream: str
    keys: int
    events: int
    rate: float  # events/s; 0 = as fast as possible
    skew: float  # Zipf exponent; 0 = uniform
    payload_bytes: int
    mode: str | None
    buckets: int | None
    seed: int


def key_weights(keys: int, skew: float) -> list[float]:
    return [1.0 if skew <= 0 else (rank + 1) ** -skew for rank in range(keys)]


def produce(load: Load) -> dict[str, Any]:
    """Publish the load; returns what was done (every event confirmed at the end)."""
    rng = random.Random(load.seed)
    names = [f"key-{n:06d}" for n in range(load.keys)]
    weights = key_weights(load.keys, load.skew)
    pad = "".join(rng.choices(string.ascii_letters, k=max(0, load.payload_bytes - 40)))
    started = time.monotonic()
    with Producer(load.stream, mode=load.mode, buckets=load.buckets) as producer:
        chosen = rng.choices(names, weights, k=load.events)
        for number, key in enumerate(chosen, 1):
            producer.publish(key, {"n": number, "pad": pad})
            if load.rate > 0:
                ahead = started + number / load.rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
        producer.flush()
        stats = producer.stats
    elapsed = time.monotonic() - started
    return {
        "stream": load.stream,
        "events": load.events,
        "keys_used": len(set(chosen)),
        "seconds": round(elapsed, 3),
        "events_per_s": round(load.events / elapsed) if elapsed else None,
        "producer": stats,
    }
