"""The garbage collector of a process that is a worker and nothing else, set before it serves.

A worker's long-lived heap is mostly what it imported before serving: pyspark, py4j,
pyarrow, the pipeline's modules. Its batches then allocate and drop tens of thousands of
objects each (deliveries, headers, rows), which reference counting frees. Python's full
collections walked all of start-up's objects each time, with the GIL held, so the I/O thread
stalled too: on the demo's workload a worker that took over a dead peer's queues spent about
1.3 s of a 12 s run collecting, 1 s of it in eleven full collections. Frozen, start-up's
objects are left out of every collection (they are still freed by reference counting if
dropped; only cycles among them would stay), and young collections run every
``YOUNG_THRESHOLD`` allocations rather than every 700, each still cheap: together the same
run spent about 0.3 s.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000  # net allocations of tracked objects between young collections


def settle_heap() -> None:
    """Collect once, freeze what survives out of later collections, and make young
    collections rarer. For ``keyq worker``'s own process: an application that embeds
    ``Worker`` decides this for its own process."""
    gc.collect()
    gc.freeze()
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
