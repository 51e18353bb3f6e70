"""``keyq demo --chaos`` end to end, small: the verdict is checked from the data in Redis,
independently of what the demo prints."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import orjson
import pytest

from keyq.demo.orders import expected_states, generate_orders
from keyq.worker.batch.state_store import StateStore
from tests.workers import FAST, REPO, keyq_environment

# Also run on RabbitMQ 4.3 in CI: the core of keyq end to end on a current broker.
pytestmark = [pytest.mark.slow, pytest.mark.broker_versions]

ORDERS, EVENTS, SEED = 80, 3000, 11


def test_demo_with_chaos_ends_with_every_order_exactly_as_published(stream: Any) -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "keyq", "demo", "--stream", stream.name, "--chaos"),
            *("--orders", str(ORDERS), "--events", str(EVENTS), "--seed", str(SEED)),
            *("--rate", "200", "--timeout", "120", "--json"),
        ],
        capture_output=True,
        text=True,
        env=keyq_environment(stream.settings, FAST),
        timeout=280,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = orjson.loads(done.stdout)
    assert summary["verdict"]["ok"] is True
    assert summary["chaos"]["actions"], "the chaos schedule did nothing in a 15 s run"
    kills = [a for a in summary["chaos"]["actions"] if a["action"] == "kill -9" and a["held"]]
    failovers = summary["chaos"]["failovers_s"]
    # Every kill of a worker that held queues is followed by a measured hand-over (the last
    # may be cut short by the end of the run), each well under the minute the measurement
    # waits: seconds, for peer reaping or the lock ttl, then claims.
    assert len(kills) - 1 <= len(failovers) <= len(kills), (kills, failovers)
    assert all(0 < seconds < 30 for seconds in failovers), failovers
    # The proof, from the data: every order's committed state is the plain-Python fold.
    suffix = summary["key_suffix"]
    published = [(order + suffix, event) for order, event in generate_orders(ORDERS, EVENTS, SEED)]
    expected = expected_states(published)
    assert len(expected) == ORDERS
    store = StateStore(stream.redis, stream.name)
    wrong = {o: store.get(o) for o, state in expected.items() if store.get(o) != state}
    assert not wrong, f"{len(wrong)} orders differ, e.g. {next(iter(wrong.items()))}"
