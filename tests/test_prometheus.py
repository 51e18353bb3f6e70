"""rabbitmq_prometheus without a broker: the text format, what keyq takes from what RabbitMQ
3.10 and 4.3 answer (tests/data, as they sent it), the HTTP side against a stand-in endpoint,
the setting. Against real nodes: tests/test_status.py, test_operating_limits.py, test_janitor.py."""

from __future__ import annotations

import base64
import logging
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from keyq.broker.errors import ConfigurationError, KeyqError, PrometheusFormatError
from keyq.broker.errors import PrometheusUnavailable as Unavailable
from keyq.broker.fd_usage import read_fd_usage
from keyq.broker.prometheus import Exposition, parse_exposition, parse_line
from keyq.broker.prometheus_api import (
    NodeFds,
    node_fds,
    node_fds_in,
    queue_figures,
    queue_figures_in,
    queue_names,
    queue_names_in,
)
from keyq.broker.settings import load_settings
from tests.servers import free_port

# What RabbitMQ answered, as it sent it, with a classic queue holding 3 messages, one of them
# out to a consumer (prefetch 1), a quorum queue holding 2, and a queue named `we"ird\q name`:
# /metrics/detailed?vhost=%2F&family=queue_coarse_metrics&family=queue_consumer_count, and
# /metrics/detailed?family=node_coarse_metrics&family=node_metrics. 3.10.8 does not escape
# label values; 4.3.6 (management_metrics_collection denied) does, and adds queue_info lines.
DATA = Path(__file__).parent / "data"
QUEUES_310 = (DATA / "rabbitmq-3.10.8-detailed-queues.txt").read_text()
QUEUES_43 = (DATA / "rabbitmq-4.3.6-detailed-queues.txt").read_text()
NODE_310 = (DATA / "rabbitmq-3.10.8-detailed-node.txt").read_text()
NODE_43 = (DATA / "rabbitmq-4.3.6-detailed-node.txt").read_text()
WEIRD = 'we"ird\\q name'


def test_a_line_is_a_name_unescaped_labels_and_a_value() -> None:
    sample = parse_line('rabbitmq_queue_messages{vhost="/",queue="keyq.o.k.1"} 42')
    assert sample is not None
    assert sample.name == "rabbitmq_queue_messages"
    assert sample.labels == {"vhost": "/", "queue": "keyq.o.k.1"}
    assert sample.value == 42
    bare = parse_line("rabbitmq_process_open_fds 39")
    assert bare is not None and bare.labels == {} and bare.value == 39
    timed = parse_line('up{job="x",} 1.5e3 1712345678000')  # a trailing comma, a timestamp
    assert timed is not None and timed.labels == {"job": "x"} and timed.value == 1500
    spaced = parse_line('  m { a = "1" , b="2"}\t-0.25  ')
    assert spaced is not None and spaced.labels == {"a": "1", "b": "2"} and spaced.value == -0.25
    assert parse_line("m{} 7") == parse_line("m 7")
    assert parse_line("# TYPE m gauge") is None and parse_line("") is None
    assert parse_line("  ") is None and parse_line("# HELP m text {with} 1") is None
    sample = parse_line(r'm{queue="we\"ird\\q\nname",x="a}b c 5"} 0')
    assert sample is not None
    assert sample.labels == {"queue": 'we"ird\\q\nname', "x": "a}b c 5"}
    values = [parse_line(f"m {text}") for text in ("NaN", "+Inf", "-Inf", "1e-3", ".5", "7.")]
    found = [sample.value for sample in values if sample is not None]
    assert math.isnan(found[0]) and found[1:] == [math.inf, -math.inf, 0.001, 0.5, 7.0]


# The first as 3.10 writes it (label values unescaped); a label twice (which one is it?); an
# escape the format does not have; a name without a value (not m = 1).
NOT_SAMPLES = r"""rabbitmq_detailed_queue_messages_ready{vhost="/",queue="we"ird\q name"} 0
m{queue="a",queue="b"} 1
m{q="a\tb"} 1
m{q="a"
m
m1
m abc
m 1_000
m 1 2.5
m{q=a} 1
m{q="a" r="b"} 1
{q="a"} 1
9m 1""".splitlines()


@pytest.mark.parametrize("line", [*NOT_SAMPLES, 'm{q="a"} '])
def test_what_is_not_a_sample_is_refused(line: str) -> None:
    with pytest.raises(PrometheusFormatError) as raised:
        parse_line(line)
    assert isinstance(raised.value, KeyqError)


def test_an_unreadable_line_is_skipped_and_counted_never_taken_nor_one_not_asked_for() -> None:
    found = parse_exposition(QUEUES_310)
    lines = QUEUES_310.splitlines()
    # The five lines of the queue whose name 3.10 did not escape, and only those.
    assert len(found.skipped) == 5 and all('"we"ird' in lines[n - 1] for n in found.skipped)
    assert all("ird" not in str(sample.labels) for sample in found.samples)
    assert len(found.named("rabbitmq_detailed_queue_messages_ready")) == 2
    [identity] = found.named("rabbitmq_identity_info")
    assert identity.labels["rabbitmq_node"].startswith("keyq")
    assert parse_exposition(QUEUES_43).skipped == []
    wanted = {"rabbitmq_detailed_queue_consumers"}
    found = parse_exposition(QUEUES_310, only=wanted)
    assert {sample.name for sample in found.samples} == wanted
    assert len(found.samples) == 2 and len(found.skipped) == 1  # of the lines asked for


def test_queue_figures_from_rabbitmq_310_and_43_and_a_queue_reported_twice_or_half() -> None:
    old = queue_figures_in([parse_exposition(QUEUES_310)], "/")
    assert old == {"keyq.t.k.a": (2, 1), "keyq.t.k.b": (2, 0)}
    new = queue_figures_in([parse_exposition(QUEUES_43)], "/")
    assert new == {"keyq.t.k.a": (2, 1), "keyq.t.k.b": (2, 0), WEIRD: (0, 0)}
    assert queue_figures_in([parse_exposition(QUEUES_43)], "other") == {}
    assert queue_names_in([parse_exposition(QUEUES_310)], "/") == {"keyq.t.k.a", "keyq.t.k.b"}
    assert queue_names_in([parse_exposition(QUEUES_43)], "/") == {"keyq.t.k.a", "keyq.t.k.b", WEIRD}
    # A queue whose name is a forged line (3.10 writes names as they are) reports a second
    # depth for another queue: neither is believed.
    forged = (
        'rabbitmq_detailed_queue_messages_ready{vhost="/",queue="keyq.t.k.a"} 0\n'
        'rabbitmq_detailed_queue_messages_ready{vhost="/",queue="x"} 0\n'
        'rabbitmq_detailed_queue_messages_ready{vhost="/",queue="keyq.t.k.a"} 999\n'
        'rabbitmq_detailed_queue_consumers{vhost="/",queue="keyq.t.k.a"} 0\n'
        'rabbitmq_detailed_queue_consumers{vhost="/",queue="x"} 0\n'
        'rabbitmq_detailed_queue_messages_ready{vhost="/",queue="no-consumer-figure"} 3\n'
        'rabbitmq_detailed_queue_messages_ready{vhost="/",queue="half"} 1.5\n'
        'rabbitmq_detailed_queue_consumers{vhost="/",queue="half"} 0\n'
        'rabbitmq_detailed_queue_messages_ready{queue="no-vhost"} 1\n'
    )
    assert queue_figures_in([parse_exposition(forged)], "/") == {"x": (0, 0)}
    # Two nodes reporting one queue (a stale entry after a leader moved): the same.
    one = parse_exposition(QUEUES_43)
    assert queue_figures_in([one, one], "/") == {}


def test_each_nodes_file_descriptors() -> None:
    assert node_fds_in(parse_exposition(NODE_43)) == NodeFds("kqprom@localhost", 42, 20000)
    old = node_fds_in(parse_exposition(NODE_310))
    assert old is not None and (old.used, old.limit) == (39, 20000)
    assert old.node.startswith("keyq") and old.node.endswith("@localhost")
    assert node_fds_in(parse_exposition(QUEUES_43)) is None  # not reported there
    no_limit = NODE_43.replace("max_fds 20000", "max_fds 0")
    assert node_fds_in(parse_exposition(no_limit)) is None
    assert node_fds_in(Exposition()) is None


@pytest.fixture
def endpoint() -> Iterator[SimpleNamespace]:
    """An HTTP server on loopback answering every GET with ``body`` (and ``status``); it
    records the paths and Authorization headers it was sent."""
    served = SimpleNamespace(body=QUEUES_43, status=200, requests=[])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served.requests.append((self.path, self.headers.get("Authorization")))
            data = served.body.encode()
            self.send_response(served.status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    served.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield served
    server.shutdown()
    server.server_close()


def test_queue_figures_ask_only_what_they_need_and_refuse_what_is_not_rabbitmqs_metrics(
    endpoint: SimpleNamespace,
) -> None:
    figures = queue_figures(endpoint.url, "/", 5, prefix="keyq.t.")
    assert figures == {"keyq.t.k.a": (2, 1), "keyq.t.k.b": (2, 0)}
    [(path, auth)] = endpoint.requests
    assert path == (
        "/metrics/detailed?vhost=%2F&family=queue_coarse_metrics&family=queue_consumer_count"
        "&queue=%5Ekeyq%5C.t%5C."
    )
    assert auth is None  # no credentials in the URL: none sent
    assert queue_names(endpoint.url, "/", 5, prefix="keyq.") == {"keyq.t.k.a", "keyq.t.k.b"}
    endpoint.body = "<html><body>RabbitMQ Management</body></html>"
    with pytest.raises(Unavailable, match="not RabbitMQ's metrics"):
        queue_figures(endpoint.url, "/", 5)
    endpoint.status = 404
    with pytest.raises(Unavailable, match="HTTP 404") as raised:
        queue_figures(endpoint.url, "/", 5)
    assert raised.value.status == 404


def test_credentials_go_in_the_header_never_in_a_message_nor_from_a_node_left_out(
    endpoint: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    secret_url = endpoint.url.replace("http://", "http://keyq:s3cret-pw@")
    endpoint.body = NODE_43
    assert node_fds(secret_url, 5) == [NodeFds("kqprom@localhost", 42, 20000)]
    [(path, auth)] = endpoint.requests
    assert path == "/metrics/detailed?family=node_coarse_metrics&family=node_metrics"
    assert auth == "Basic " + base64.b64encode(b"keyq:s3cret-pw").decode()
    endpoint.status = 401
    with pytest.raises(Unavailable) as refused:
        node_fds(secret_url, 5)
    assert refused.value.status == 401
    assert "credentials were refused" in str(refused.value)
    assert "s3cret-pw" not in str(refused.value) and "keyq:***@" in str(refused.value)
    # A node that does not answer is left out, until none does.
    endpoint.body, endpoint.status = QUEUES_43, 200
    caplog.set_level(logging.INFO, logger="keyq.broker")
    closed = f"http://keyq:s3cret-pw@127.0.0.1:{free_port()}"
    both = f"{closed},{endpoint.url}"
    assert queue_figures(both, "/", 5)["keyq.t.k.a"] == (2, 1)
    [record] = caplog.records
    assert "did not answer" in record.getMessage() and "left out" in record.getMessage()
    with pytest.raises(Unavailable, match="did not answer") as raised:
        queue_figures(closed, "/", 5)
    assert "s3cret-pw" not in str(raised.value) + caplog.text


def test_fd_figures_come_from_prometheus_first(endpoint: SimpleNamespace) -> None:
    endpoint.body = NODE_43
    closed = f"http://127.0.0.1:{free_port()}"
    usage = read_fd_usage(load_settings(prometheus_url=endpoint.url, management_url=closed))
    assert (usage.used, usage.limit, usage.node) == (42, 20000, "kqprom@localhost")
    assert usage.source == "prometheus" and usage.as_dict()["source"] == "prometheus"
    endpoint.body = QUEUES_43  # answering, without the node's figures
    usage = read_fd_usage(load_settings(prometheus_url=endpoint.url, management_url=""))
    assert not usage.known and usage.unknown_reason == (
        "rabbitmq_prometheus reports no fd figures yet"
    )
    usage = read_fd_usage(load_settings(prometheus_url=closed, management_url=closed))
    assert not usage.known and "management API" in str(usage.unknown_reason)
    usage = read_fd_usage(load_settings(prometheus_url=closed, management_url=""))
    assert not usage.known and "rabbitmq_prometheus" in str(usage.unknown_reason)


def test_the_prometheus_url_is_checked_and_never_shown() -> None:
    settings = load_settings(prometheus_url="http://keyq:s3cret-pw@mq-1:15692,http://mq-2:15692")
    assert settings.describe()["prometheus_url"] == "http://keyq:***@mq-1:15692,http://mq-2:15692"
    assert "s3cret-pw" not in repr(settings)
    assert load_settings(prometheus_url="").prometheus_url is None
    assert load_settings(prometheus_url=" , ").prometheus_url is None
    for wrong in (
        "amqp://keyq:s3cret-pw@mq:5672",
        "http://keyq:s3cret-pw@mq:15692/metrics",
        "http://keyq:s3cret-pw@mq:15692/metrics/per-object",
        "http://keyq:s3cret-pw@mq:15692?family=queue_coarse_metrics",
        "http://keyq:s3cret-pw@:15692",
        "http://keyq:s3cret-pw@mq:99999",
    ):
        with pytest.raises(ConfigurationError, match="KEYQ_PROMETHEUS_URL") as raised:
            load_settings(prometheus_url=wrong)
        assert "s3cret-pw" not in str(raised.value), wrong
