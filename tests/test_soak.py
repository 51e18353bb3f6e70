"""The combined-fault soak (see ``tests/soak.py``): every fault at once, every event checked.

It runs for ``KEYQ_SOAK_SECONDS`` (default 45) with a fresh seed, printed with the schedule, that
``KEYQ_SOAK_SEED`` replays. The cluster soak (a private 3-node RabbitMQ cluster, quorum queues,
node faults) takes 4-9 minutes: it runs only with ``KEYQ_SOAK_CLUSTER=1``;
``tests/test_cluster.py`` checks the same guarantees through node kills.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import cluster_available
from tests.servers import private_servers_available
from tests.soak import NODE_FAULTS, SoakReport, run_soak

SECONDS = float(os.environ.get("KEYQ_SOAK_SECONDS", "45"))
SEED = int(os.environ.get("KEYQ_SOAK_SEED") or random.SystemRandom().randrange(1, 10**6))
CLUSTER_SECONDS = float(os.environ.get("KEYQ_SOAK_CLUSTER_SECONDS", "45"))

# It starts private RabbitMQ and Redis servers of its own, and Spark.
pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.services]


def _run_and_judge(
    tmp_path: Path, seconds: float, drain_timeout: float, **options: Any
) -> SoakReport:
    """One soak, and what every soak must show: Redis back, the producers publishing, planted
    dead letters and janitor deletes, a clean verdict, the auto stream's keys promoted and
    demoted."""
    report = run_soak(tmp_path, SEED, seconds, drain_timeout, **options)
    assert any("Redis: back" in line for line in report.done)
    assert report.events_accepted > seconds * 50, "the producers hardly published"
    assert report.dead_letters_planted >= 3
    assert report.janitor_deleted > 0, "the janitor never deleted a queue: no race was tried"
    assert report.clean, f"seed {SEED}: {json.dumps(report.bad_keys, ensure_ascii=False)[:3000]}"
    assert report.promotions > 0, f"seed {SEED}: no key promoted: {report.route_counts}"
    assert report.demotions > 0, f"seed {SEED}: no key demoted: {report.route_counts}"
    return report


@pytest.mark.timeout(SECONDS + 900)
def test_every_fault_at_once_loses_reorders_and_repeats_nothing(tmp_path: Path) -> None:
    missing = private_servers_available()
    if missing:
        pytest.skip(f"the soak starts its own RabbitMQ and Redis to restart them: {missing}")
    report = _run_and_judge(tmp_path, SECONDS, 240)
    assert any("RabbitMQ: back" in line for line in report.done)


@pytest.mark.timeout(CLUSTER_SECONDS + 600)
def test_a_quorum_cluster_soak_survives_node_faults_and_loses_nothing(tmp_path: Path) -> None:
    if os.environ.get("KEYQ_SOAK_CLUSTER") != "1":
        pytest.skip("the cluster soak takes 4-9 minutes: set KEYQ_SOAK_CLUSTER=1 to run it")
    missing = cluster_available() or private_servers_available()
    if missing:
        pytest.skip(f"the cluster soak starts a 3-node RabbitMQ cluster and a Redis: {missing}")
    # A first janitor delete is awaited 10 s after draining (the single-broker soak waits up
    # to 90 s, more than this test's budget).
    options = {"cluster": True, "janitor_catch_up": 10.0, "progress_every": 15.0}
    report = _run_and_judge(tmp_path, CLUSTER_SECONDS, 180, **options)
    for kind in NODE_FAULTS:
        assert report.faults_applied.get(kind, 0) >= 1, f"no {kind}: {report.faults_applied}"
