"""Wall-clock milliseconds, the unit of every timestamp keyq keeps in Redis."""

from __future__ import annotations

import time


def now_ms() -> int:
    return int(time.time() * 1000)
