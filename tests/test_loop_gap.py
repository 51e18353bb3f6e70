"""``ConsumerLink.max_loop_gap_s``: how long the I/O thread was held up, measured on the real
broker (work run on the I/O thread, as any slow work there would be, shows as a gap)."""

from __future__ import annotations

import time

from keyq.broker.settings import Settings
from tests.conftest import StreamFixture
from tests.workers import bare_link


def test_work_on_the_io_thread_shows_as_a_loop_gap_until_reset(
    settings: Settings, stream: StreamFixture
) -> None:
    link = bare_link(settings, stream.name, "test-loop-gap", prefetch=10)
    link.start()
    try:
        time.sleep(0.3)  # the loop idles: iterations about 50 ms apart
        assert link.max_loop_gap_s < 0.4
        link.call(lambda: time.sleep(0.6))
        assert link.max_loop_gap_s >= 0.6
        link.reset_loop_gap()
        assert link.max_loop_gap_s == 0.0
        time.sleep(0.3)
        assert 0.0 < link.max_loop_gap_s < 0.4
    finally:
        link.stop()
