"""The Prometheus endpoint: the text format (parsed back line by line), the HTTP server
(scraped over real HTTP), and real scrapes of a janitor and a worker on the real services."""

from __future__ import annotations

import errno
import logging
import re
import socket
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pika
import pytest

from keyq import Producer
from keyq.broker.metrics import (
    CONTENT_TYPE,
    Histogram,
    Metric,
    MetricsServer,
    Summary,
    format_value,
    render,
    start_first_free,
)
from keyq.broker.settings import load_settings
from keyq.janitor.config import JanitorSettings
from keyq.janitor.janitor import Janitor
from keyq.janitor.metrics import janitor_metrics
from keyq.worker.config import WorkerSettings
from keyq.worker.daemon import Worker
from keyq.worker.metrics import BatchLatency, worker_metrics
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.workers import wait_until

# ---- a parser of the text format, independent of the renderer -----------------------------

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)\Z")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|\})')
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def _parse_labels(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    labels: dict[str, str] = {}
    position = 1  # after "{"
    while position < len(text):
        match = _LABEL_PAIR.match(text, position)
        assert match, f"bad labels at {text[position:]!r}"
        assert match.group(1) not in labels, f"label {match.group(1)} twice"
        labels[match.group(1)] = _unescape(match.group(2))
        position = match.end()
    assert text.endswith("}")
    return labels


def _parse_value(text: str) -> float:
    return float(text)  # also reads +Inf, -Inf and NaN


@dataclass
class Family:
    help: str = ""
    kind: str = ""
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def value(self, name: str | None = None, **labels: str) -> float:
        """The one sample named ``name`` (the family's own by default) whose labels include
        ``labels``."""
        hits = [
            value
            for sample, have, value in self.samples
            if (name is None or sample == name) and labels.items() <= have.items()
        ]
        assert len(hits) == 1, f"{len(hits)} samples of {name} with {labels}"
        return hits[0]


def parse(text: str) -> dict[str, Family]:
    """The families of an exposition, checking its structure on the way."""
    assert text == "" or text.endswith("\n")
    families: dict[str, Family] = {}
    current: str | None = None
    for line in text.splitlines():
        assert line, "no blank lines"
        if line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP ") :].partition(" ")
            assert name not in families, f"family {name} twice"
            families[name] = Family(help=_unescape(help_text))
            current = name
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE ") :].partition(" ")
            assert name == current and kind in {"counter", "gauge", "summary", "histogram"}
            families[name].kind = kind
        else:
            match = _SAMPLE.match(line)
            assert match and current is not None, f"bad sample line {line!r}"
            sample = match.group(1)
            family = families[current]
            suffixes = _SUFFIXES.get(family.kind, ("",))
            assert any(sample == current + suffix for suffix in suffixes), line
            if family.kind == "counter":
                assert sample.endswith("_total")
            family.samples.append(
                (sample, _parse_labels(match.group(2)), _parse_value(match.group(3)))
            )
    return families


def scrape(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    """(status, content type, body) of a GET on the local server."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()


def scrape_families(port: int) -> dict[str, Family]:
    status, content_type, body = scrape(port)
    assert status == 200 and content_type == CONTENT_TYPE
    return parse(body)


# ---- the text format ------------------------------------------------------------------------

TRICKY = 'say "hi"\\there\nnext line'


def test_render_round_trips_help_types_labels_and_escapes() -> None:
    text = render(
        [
            Metric(
                "keyq_things_total",
                "counter",
                "Things, with a back\\slash\nand a newline.",
                [({"stream": TRICKY, "worker": "w-1"}, 7), ({"stream": "plain", "worker": ""}, 0)],
            ),
            Metric("keyq_level", "gauge", "A level.", [({}, 2.5), ({"k": "v"}, float("inf"))]),
            Metric(
                "keyq_latency_seconds",
                "histogram",
                "Latency.",
                [({"s": "x"}, Histogram(buckets=[(0.1, 1), (1, 3)], count=4, sum=5.25))],
            ),
            Metric(
                "keyq_size",
                "summary",
                "Sizes.",
                [({}, Summary(quantiles=[(0.5, 2.0), (0.99, 9.0)], count=10, sum=30.0))],
            ),
            Metric("keyq_empty_total", "counter", "No samples yet."),
        ]
    )
    assert '{stream="say \\"hi\\"\\\\there\\nnext line",worker="w-1"} 7\n' in text
    families = parse(text)
    assert list(families) == [
        "keyq_things_total",
        "keyq_level",
        "keyq_latency_seconds",
        "keyq_size",
        "keyq_empty_total",
    ]
    things = families["keyq_things_total"]
    assert things.kind == "counter"
    assert things.help == "Things, with a back\\slash\nand a newline."
    assert things.value(stream=TRICKY) == 7
    assert things.value(stream="plain", worker="") == 0
    level = families["keyq_level"]
    assert level.kind == "gauge"
    assert level.samples == [("keyq_level", {}, 2.5), ("keyq_level", {"k": "v"}, float("inf"))]
    latency = families["keyq_latency_seconds"]
    assert latency.kind == "histogram"
    assert [(s, labels["le"], v) for s, labels, v in latency.samples[:3]] == [
        ("keyq_latency_seconds_bucket", "0.1", 1),
        ("keyq_latency_seconds_bucket", "1.0", 3),
        ("keyq_latency_seconds_bucket", "+Inf", 4),
    ]
    assert latency.value("keyq_latency_seconds_sum", s="x") == 5.25
    assert latency.value("keyq_latency_seconds_count", s="x") == 4
    size = families["keyq_size"]
    assert size.value("keyq_size", quantile="0.99") == 9.0
    assert size.value("keyq_size_count") == 10
    assert families["keyq_empty_total"].samples == []


def test_values_are_written_as_the_format_wants() -> None:
    assert format_value(3) == "3"
    assert format_value(True) == "1"
    assert format_value(0.25) == "0.25"
    assert format_value(float("inf")) == "+Inf"
    assert format_value(float("-inf")) == "-Inf"
    assert format_value(float("nan")) == "NaN"
    assert render([]) == ""


@pytest.mark.parametrize(
    ("build", "problem"),
    [
        (lambda: Metric("9bad", "gauge", "h"), "invalid metric name"),
        (lambda: Metric("keyq_things", "counter", "h"), "end in _total"),
        (lambda: Metric("m", "meter", "h"), "unknown kind"),  # type: ignore[arg-type]
        (lambda: Metric("m", "gauge", "h", [({"__x": "v"}, 1)]), "invalid label name"),
        (lambda: Metric("m", "gauge", "h", [({"a-b": "v"}, 1)]), "invalid label name"),
        (lambda: Metric("m", "gauge", "h", [({"a": "1"}, 1), ({"a": "1"}, 2)]), "duplicate"),
        (lambda: Metric("m_total", "counter", "h", [({}, -1)]), "cannot be"),
        (lambda: Metric("m", "gauge", "h", [({}, Histogram([], 0, 0))]), "takes a number"),
        (lambda: Metric("m", "histogram", "h", [({}, 1.0)]), "takes a Histogram"),
        (
            lambda: Metric("m", "histogram", "h", [({"le": "1"}, Histogram([], 0, 0))]),
            "reserved",
        ),
        (
            lambda: Metric("m", "histogram", "h", [({}, Histogram([(1, 2), (0.5, 3)], 3, 1))]),
            "ascending",
        ),
        (
            lambda: Metric("m", "histogram", "h", [({}, Histogram([(1, 2), (2, 1)], 3, 1))]),
            "cumulative",
        ),
        (lambda: Metric("m", "summary", "h", [({}, Summary([(1.5, 1)], 1, 1))]), "quantiles"),
        (lambda: render([Metric("m", "gauge", "h"), Metric("m", "gauge", "h")]), "twice"),
    ],
)
def test_bad_families_are_refused_where_they_are_built(build: Any, problem: str) -> None:
    with pytest.raises((ValueError, TypeError), match=problem):
        build()


def test_batch_latency_observes_each_duration_once() -> None:
    latency = BatchLatency(bounds=(0.1, 1.0))
    window = [0.05, 0.5]
    latency.update(window)
    latency.update(window)  # nothing new
    window.append(2.0)
    latency.update(window)
    del window[:2]  # the processor's window scrolled
    window.append(0.07)
    latency.update(window)
    snapshot = latency.snapshot()
    assert snapshot.buckets == [(0.1, 2), (1.0, 3)]
    assert snapshot.count == 4
    assert snapshot.sum == pytest.approx(2.62)
    latency.update([0.2])  # a new window (a new processor): all of it is new
    assert latency.snapshot().count == 5


# ---- the server -----------------------------------------------------------------------------


def test_server_serves_metrics_and_health_over_http() -> None:
    calls: list[int] = []
    broken = threading.Event()

    def collect() -> list[Metric]:
        if broken.is_set():
            raise RuntimeError("collector broke")
        calls.append(1)
        return [Metric("keyq_scrapes_total", "counter", "Scrapes.", [({"n": "x"}, len(calls))])]

    server = MetricsServer(0, "127.0.0.1", collect=collect)
    assert server.port == 0
    with server:
        port = server.port
        assert port > 0
        assert scrape_families(port)["keyq_scrapes_total"].value(n="x") == 1
        assert scrape_families(port)["keyq_scrapes_total"].value(n="x") == 2
        assert scrape(port, "/metrics?name[]=x")[0] == 200
        assert scrape(port, "/healthz")[::2] == (200, "ok")
        assert scrape(port, "/nothing")[0] == 404
        broken.set()
        status, _type, body = scrape(port)
        assert status == 500 and "failed" in body
        broken.clear()
        assert scrape(port)[0] == 200  # still serving
        with pytest.raises(RuntimeError, match="already started"):
            server.start()
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    server.stop()  # twice is fine


def test_a_taken_port_fails_at_start() -> None:
    with MetricsServer(0, "127.0.0.1", collect=list) as first, pytest.raises(OSError):
        MetricsServer(first.port, "127.0.0.1", collect=list).start()


def _listening(port: int) -> socket.socket | None:
    """A socket listening on 127.0.0.1:port, or None if something else has the port."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
    except OSError:
        sock.close()
        return None
    return sock


def test_a_taken_port_moves_to_the_next_free_one_of_its_span(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with MetricsServer(0, "127.0.0.1", collect=list) as first:
        caplog.set_level(logging.WARNING, logger="keyq.metrics")
        second = start_first_free(first.port, 4, "127.0.0.1", collect=list)
        try:
            assert first.port < second.port < first.port + 4
            assert scrape(second.port, "/healthz")[::2] == (200, "ok")
            assert f"metrics port {first.port} is taken; serving on {second.port}" in caplog.text
        finally:
            second.stop()


def test_a_span_with_every_port_taken_fails_naming_the_span() -> None:
    with MetricsServer(0, "127.0.0.1", collect=list) as first:
        # The next port is taken by this test, or by someone else: taken either way.
        blocker = _listening(first.port + 1)
        try:
            with pytest.raises(OSError, match=rf"ports {first.port}-{first.port + 1} are all"):
                start_first_free(first.port, 2, "127.0.0.1", collect=list)
            with pytest.raises(OSError, match=rf"port {first.port} is taken"):
                start_first_free(first.port, 1, "127.0.0.1", collect=list)
        finally:
            if blocker is not None:
                blocker.close()


def test_a_bind_failure_that_is_no_clash_is_not_passed_over() -> None:
    # An address this machine does not have: no port of the span could ever be bound.
    with pytest.raises(OSError) as failure:
        start_first_free(47_000, 5, "192.0.2.123", collect=list)
    assert failure.value.errno == errno.EADDRNOTAVAIL


# ---- real daemons ---------------------------------------------------------------------------

LEASE_MS = 200
GRACE_MS = 500


def test_a_janitor_scrape_counts_its_deletions(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    fast = load_settings(publish_lease_ms=LEASE_MS, retire_grace_ms=GRACE_MS)
    with Producer(stream.name, mode="key", settings=fast) as producer:
        queues = sorted({producer.publish(k, {"n": 1}).queue for k in ("a", "b", "c")})
        producer.flush(30)
    channel = amqp.channel()
    for queue in queues:
        channel.queue_purge(queue)
    channel.close()

    janitor = Janitor(
        [stream.name],
        settings=load_settings(
            JanitorSettings, idle_ttl_s=0, publish_lease_ms=LEASE_MS, retire_grace_ms=GRACE_MS
        ),
    )
    with MetricsServer(0, "127.0.0.1", collect=lambda: janitor_metrics(janitor)) as server:
        before = scrape_families(server.port)
        assert before["keyq_janitor_deletions_total"].value(janitor=janitor.janitor_id) == 0
        janitor.run(once=True)
        deleted = [queue for queue in queues if queue_depth(amqp, queue) is None]
        families = scrape_families(server.port)

    assert len(deleted) == 3
    labels = {"janitor": janitor.janitor_id}
    assert families["keyq_janitor_deletions_total"].value(**labels) == len(deleted)
    assert families["keyq_janitor_passes_total"].value(**labels) == 1
    skipped = families["keyq_janitor_skipped_total"]
    assert {s[1]["reason"] for s in skipped.samples} == {
        "held",
        "not_empty",
        "in_use",
        "unreachable",
        "mark_lapsed",
    }
    assert all(s[1]["janitor"] == janitor.janitor_id and s[2] == 0 for s in skipped.samples)
    for name in (
        "keyq_janitor_adopted_total",
        "keyq_janitor_members_pruned_total",
        "keyq_janitor_errors_total",
    ):
        assert families[name].kind == "counter"
        assert families[name].value(**labels) == 0


WORKER_COUNTERS = (
    "keyq_worker_events_processed_total",
    "keyq_worker_events_skipped_total",
    "keyq_worker_batches_total",
    "keyq_worker_spark_seconds_total",
    "keyq_worker_claims_total",
    "keyq_worker_releases_total",
    "keyq_worker_queues_lost_total",
    "keyq_worker_dead_lettered_total",
    "keyq_worker_commits_refused_total",
    "keyq_worker_peers_reaped_total",
)


def test_a_worker_scrape_counts_its_events(stream: StreamFixture, spark_engine: Any) -> None:
    with Producer(stream.name, mode="key", settings=stream.settings) as producer:
        for n in range(1, 11):
            for key in ("sensor-1", "sensor-2"):
                producer.publish(key, {"n": n, "producer": "p"})
        producer.flush(30)
    worker = Worker(
        stream.name,
        "tests.pipelines:audit",
        settings=load_settings(WorkerSettings),
        engine=spark_engine,
    )
    labels = {"stream": stream.name, "worker": worker.worker_id}

    def events(families: dict[str, Family]) -> float:
        return families["keyq_worker_events_processed_total"].value(**labels)

    runner = threading.Thread(target=worker.run, kwargs={"until_idle": 2}, daemon=True)
    with MetricsServer(0, "127.0.0.1", collect=lambda: worker_metrics(worker)) as server:
        assert events(scrape_families(server.port)) == 0  # served before the worker runs
        runner.start()
        try:
            # Scraped while the worker runs, then once it stopped by itself.
            wait_until(lambda: events(scrape_families(server.port)) == 20, 60, "20 events")
            runner.join(60)
            assert not runner.is_alive()
            families = scrape_families(server.port)
        finally:
            worker.stop()
            runner.join(30)

    for name in WORKER_COUNTERS:
        assert families[name].kind == "counter", name
    assert events(families) == 20
    assert families["keyq_worker_events_skipped_total"].value(**labels) == 0
    assert families["keyq_worker_claims_total"].value(**labels) >= 2  # one queue per key
    assert families["keyq_worker_dead_lettered_total"].value(**labels) == 0
    assert families["keyq_worker_spark_seconds_total"].value(**labels) > 0
    assert families["keyq_worker_queues_held"].kind == "gauge"
    assert families["keyq_worker_queues_held"].value(**labels) == 0  # all handed back
    batches = families["keyq_worker_batches_total"].value(**labels)
    assert batches >= 1
    latency = families["keyq_worker_batch_seconds"]
    assert latency.kind == "histogram"
    assert latency.value("keyq_worker_batch_seconds_count", **labels) == batches
    assert latency.value("keyq_worker_batch_seconds_sum", **labels) > 0
    assert latency.value("keyq_worker_batch_seconds_bucket", le="+Inf", **labels) == batches
