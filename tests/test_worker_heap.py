"""``keyq worker``'s garbage collector: start-up's objects frozen out of collections, young
collections rarer, and garbage made afterwards still collected. Run in a child interpreter so
this test process's own collector is left as it is."""

from __future__ import annotations

import json
import subprocess
import sys

from keyq.worker.heap import YOUNG_THRESHOLD

CHILD = """
import gc, json, weakref
from keyq.worker.heap import settle_heap

before = gc.get_threshold()
started_with = [object() for _ in range(1000)]  # alive at start-up
settle_heap()
frozen = gc.get_freeze_count()
class Node:
    pass
# A cycle made after start-up, then dropped: only the cyclic collector can free it.
a, b = Node(), Node()
a.other, b.other = b, a
gone = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": frozen,
                  "started_with": len(started_with), "cycle_freed": gone() is None}))
"""


def test_settle_heap_freezes_start_up_and_still_collects_later_cycles() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True
    )
    found = json.loads(done.stdout)
    assert found["frozen"] >= found["started_with"]  # start-up's objects left out
    assert found["after"] == [YOUNG_THRESHOLD, *found["before"][1:]]
    assert found["cycle_freed"] is True


def test_the_worker_command_settles_its_heap_before_serving() -> None:
    probe = """
import gc, json
import keyq.cli.daemons as daemons
import keyq.worker.daemon as worker_daemon
class Stop(Exception):
    pass
def run(self, until_idle=None):  # where the worker would start serving: settled by now?
    print(json.dumps({"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()}))
    raise Stop
worker_daemon.Worker.run = run
try:
    daemons.run_worker_daemon(stream="heap-probe", pipeline="bench.pipelines:count", sink=None,
        mode=None, buckets=None, until_idle=None, worker_id=None, metrics_port=None,
        log_level="warning")
except Stop:
    pass
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["frozen"] > 0
    assert found["threshold"][0] == YOUNG_THRESHOLD
