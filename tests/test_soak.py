"""The combined-fault soak (see ``tests/soak.py``): every fault at once, every event checked.

In the suite it runs for ``KEYQ_SOAK_SECONDS`` (default 45) with a fresh seed each time; the
seed and schedule are printed so a failure can be replayed with ``KEYQ_SOAK_SEED``. Its three
streams (key, bucket and auto mode) share the one schedule; the auto stream's keys must have
been promoted and demoted during the run, or its moves were never tried.

The cluster soak runs the same on a private 3-node RabbitMQ cluster with quorum queues and node
faults, for ``KEYQ_SOAK_CLUSTER_SECONDS`` (default 45; node faults take turns and a node
restart is slow on a loaded machine, so the run takes 4-9 minutes in all). It is too long for
every run of the suite (``tests/test_cluster.py`` checks the same guarantees through node
kills in about two minutes): it runs when ``KEYQ_SOAK_CLUSTER=1`` is set. A long one by hand:
``.venv/bin/python -m tests.soak --cluster --seconds 600 --seed 7``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tests.cluster import cluster_available
from tests.servers import private_servers_available
from tests.soak import NODE_FAULTS, SoakReport, soak_run

SECONDS = float(os.environ.get("KEYQ_SOAK_SECONDS", "45"))
SEED = int(os.environ.get("KEYQ_SOAK_SEED") or random.SystemRandom().randrange(1, 10**6))
CLUSTER_SECONDS = float(os.environ.get("KEYQ_SOAK_CLUSTER_SECONDS", "45"))
# After draining, how long the cluster soak waits for a first janitor delete (the single-broker
# soak waits up to 90 s, more than this test's budget).
CLUSTER_JANITOR_CATCH_UP_S = 10.0


def assert_auto_mode_exercised(report: SoakReport) -> None:
    """Keys of the auto stream moved both ways: promoted (by the operator fault or by their
    rate or backlog) and demoted (their idle own queue deleted by the janitor)."""
    assert report.promotions > 0, f"seed {SEED}: no key promoted: {report.route_counts}"
    assert report.demotions > 0, f"seed {SEED}: no key demoted: {report.route_counts}"


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
    print(report.verdict())
    assert any("Redis: back" in line for line in report.done)
    assert any("RabbitMQ: back" in line for line in report.done)
    assert report.events_accepted > SECONDS * 50, "the producers hardly published"
    assert report.dead_letters_planted >= 3
    assert report.janitor_deleted > 0, "the janitor never deleted a queue: no race was tried"
    assert report.clean, f"seed {SEED}: {json.dumps(report.bad_keys, ensure_ascii=False)[:3000]}"
    assert_auto_mode_exercised(report)


@pytest.mark.timeout(CLUSTER_SECONDS + 600)
def test_a_quorum_cluster_soak_survives_node_faults_and_loses_nothing(tmp_path: Path) -> None:
    if os.environ.get("KEYQ_SOAK_CLUSTER") != "1":
        pytest.skip("the cluster soak takes 4-9 minutes: set KEYQ_SOAK_CLUSTER=1 to run it")
    missing = cluster_available() or private_servers_available()
    if missing:
        pytest.skip(f"the cluster soak starts a 3-node RabbitMQ cluster and a Redis: {missing}")
    with soak_run(
        tmp_path,
        SEED,
        CLUSTER_SECONDS,
        cluster=True,
        janitor_catch_up=CLUSTER_JANITOR_CATCH_UP_S,
        progress_every=15.0,
    ) as soak:
        soak.run_faults()
        report = soak.finish(drain_timeout=180)
    (tmp_path / "soak-report.json").write_text(report.text())
    print(report.text())
    print(report.verdict())
    assert any("Redis: back" in line for line in report.done)
    for kind in NODE_FAULTS:
        assert report.faults_applied.get(kind, 0) >= 1, f"no {kind}: {report.faults_applied}"
    assert report.events_accepted > CLUSTER_SECONDS * 50, "the producers hardly published"
    assert report.dead_letters_planted >= 3
    assert report.janitor_deleted > 0, "the janitor never deleted a queue: no race was tried"
    assert report.clean, f"seed {SEED}: {json.dumps(report.bad_keys, ensure_ascii=False)[:3000]}"
    assert_auto_mode_exercised(report)
