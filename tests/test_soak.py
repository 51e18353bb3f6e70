"""The combined-fault soak (see ``tests/soak.py``): every fault at once, every event checked.

In the suite it runs for ``KEYQ_SOAK_SECONDS`` (default 45) with a fresh seed each time; the
seed and schedule are printed so a failure can be replayed with ``KEYQ_SOAK_SEED``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tests.servers import private_servers_available
from tests.soak import soak_run

SECONDS = float(os.environ.get("KEYQ_SOAK_SECONDS", "45"))
SEED = int(os.environ.get("KEYQ_SOAK_SEED") or random.SystemRandom().randrange(1, 10**6))

# It starts private RabbitMQ and Redis servers of its own, and Spark.
pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.services]


@pytest.mark.timeout(SECONDS + 900)
def test_every_fault_at_once_loses_reorders_and_repeats_nothing(tmp_path: Path) -> None:
    missing = private_servers_available()
    if missing:
        pytest.skip(f"the soak starts its own RabbitMQ and Redis to restart them: {missing}")
    with soak_run(tmp_path, SEED, SECONDS) as soak:
        soak.run_faults()
        report = soak.finish(drain_timeout=240)
    (tmp_path / "soak-report.json").write_text(report.text())
    print(report.text())
    assert any("Redis: back" in line for line in report.done)
    assert any("RabbitMQ: back" in line for line in report.done)
    assert report.events_accepted > SECONDS * 50, "the producers hardly published"
    assert report.dead_letters_planted >= 3
    assert report.janitor_deleted > 0, "the janitor never deleted a queue: no race was tried"
    assert report.clean, f"seed {SEED}: {json.dumps(report.bad_keys, ensure_ascii=False)[:3000]}"
